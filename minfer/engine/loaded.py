"""A model loaded for generation: device, dtype, backend, weights, tokenizer and context length. The
static-batch Engine and the continuous-batching EngineCore both start from it."""
from __future__ import annotations

import time

import torch

from .. import loader
from ..config import ModelConfig
from ..errors import MinferError
from ..model import Transformer
from ..ops import cuda_available, get_backend


def parse_device(name: str | None) -> torch.device:
    """--device as a torch device (None: cuda if there is a GPU), or a one-line error."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise MinferError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise MinferError(f"--device {name}: minfer runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MinferError(f"--device {name} asked for, but no CUDA GPU is visible")
    if device.index is not None and device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise MinferError(f"--device {name}: there are {torch.cuda.device_count()} GPUs")
    return device


def _backend(name: str, device: torch.device):
    if name not in ("auto", "cuda", "ref"):
        raise MinferError(f"--backend {name!r}: use auto, cuda or ref")
    if name == "cuda" and device.type != "cuda":
        raise MinferError("--backend cuda needs a CUDA GPU" if not torch.cuda.is_available()
                          else "--backend cuda needs --device cuda")
    if name == "cuda" and not cuda_available():
        raise MinferError("--backend cuda: the CUDA extension (minfer._C) is not built; run setup.sh")
    return get_backend(name, device)


class LoadedModel:
    def __init__(self, checkpoint: str | None = None, dtype: torch.dtype | None = None, device: str | None = None,
                 backend: str = "auto", max_context: int | None = None, random_weights: ModelConfig | None = None,
                 dequantize: bool = False):
        """random_weights: instead of a checkpoint, random weights of this config's shape and no tokenizer
        (token ids in, token ids out), for benchmarks. dequantize: a GGUF's quantized matrices are
        expanded to `dtype` at load instead of staying in their blocks; the ref backend always expands
        them (it has no kernels that read blocks, and would dequantize every matrix at every step)."""
        t0 = time.perf_counter()
        if max_context is not None and not (isinstance(max_context, int) and max_context >= 2):
            raise MinferError(f"--max-context (max_model_len) must be at least 2, not {max_context!r}")
        self.device = parse_device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.ops = _backend(backend, self.device)
        self.load_times = loader.LoadTimes(device=self.device)
        if random_weights is None:
            self.cfg, weights, self.tokenizer = loader.load(checkpoint, self.dtype, self.device, self.load_times,
                                                            dequantize or self.ops.name != "cuda")
        else:
            from ..shapes import random_weights as make_weights
            self.cfg, weights, self.tokenizer = random_weights, make_weights(random_weights, self.dtype, self.device), None
        if self.dtype == torch.float16 and self.cfg.arch == "gemma3":  # vLLM refuses it too
            raise MinferError("Gemma 3 overflows float16 (its activations pass 65504, every logit then NaN): "
                              "use --dtype bfloat16 or float32")
        limit = self.cfg.max_position_embeddings
        if max_context is not None and max_context > limit:  # as vLLM: positions the model was never trained on
            raise MinferError(f"--max-context (max_model_len) {max_context} is past the model's {limit} positions "
                              f"(max_position_embeddings)")
        self.max_context = max_context or limit
        self.model = Transformer(self.cfg, weights, self.ops, self.max_context)
        self._sync()
        self.load_s = time.perf_counter() - t0

    def check_prompt_fits(self, n: int, new_tokens: int = 1) -> None:
        """A prompt of n tokens leaves room for new_tokens more (0: a prompt scored alone), or a one-line error that
        says what to do."""
        if n + new_tokens <= self.max_context:
            return
        limit = self.cfg.max_position_embeddings
        hint = (f"raise --max-context, up to {limit}" if self.max_context < limit
                else f"the model holds {limit} positions: shorten the prompt")
        raise MinferError(f"prompt is {n} tokens and the context holds {self.max_context}: no room to generate "
                          f"({hint})")

    @classmethod
    def from_random_weights(cls, cfg: ModelConfig, **kwargs):
        return cls(random_weights=cfg, **kwargs)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Copies of tensors on the host (pinned on a GPU, where the copies are asynchronous) and the event after
        which they may be read (None off the GPU: they are done)."""
        host = [x.to("cpu", non_blocking=True) for x in tensors]
        if self.device.type != "cuda":
            return host, None
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def encode(self, text: str, chat: bool, system: str | None = None) -> list[int]:
        if not chat:
            return self.tokenizer.encode(text, self.max_context)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return self.tokenizer.encode_chat(messages, self.max_context)
