"""Checkpoint -> (ModelConfig, weights {HF name: tensor}, Tokenizer).

CHECKPOINT is an HF folder (config.json + model.safetensors or a sharded index), an HF hub id
(through huggingface_hub; honours HF_HUB_OFFLINE and the local cache), or a .gguf file. With none,
the default model that setup.sh installs.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import gguf, tokenizer
from .config import ModelConfig
from .errors import MinferError, check_readable, file_error, open_input, read_json
from .fetch import DEFAULT_MODEL_FILE, MODELS, cache_dir  # the models setup.sh installs, and their folder


@dataclass
class LoadTimes:
    """Seconds spent reading the checkpoint into host memory, uploading it to the device, and dequantizing
    (or casting, un-permuting) it there. Each phase ends with a device sync, so that none hides another."""
    read: float = 0.0
    upload: float = 0.0
    dequantize: float = 0.0
    device: torch.device = torch.device("cpu")

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        setattr(self, phase, getattr(self, phase) + time.perf_counter() - t0)


def default_checkpoint() -> str:
    path = os.path.join(cache_dir(), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise MinferError(f"default model not found at {path}; run `bash setup.sh` (or pass a CHECKPOINT)")
    return path


def _progress(items, desc):
    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr, leave=False, disable=None)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve(checkpoint: str | None) -> str:
    """A local path for CHECKPOINT (a path, a hub id, downloaded into the HF cache, or the name of a model
    minfer.fetch installs, such as gemma3-270m)."""
    if checkpoint is None:
        return default_checkpoint()
    path = os.path.expanduser(checkpoint)
    try:
        os.stat(path)
        return path
    except FileNotFoundError:
        pass
    except OSError as e:  # e.g. a folder on the way that we may not search
        raise file_error(path, e) from None
    if _looks_like_hub_id(checkpoint):
        from huggingface_hub import snapshot_download
        try:
            return snapshot_download(checkpoint, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"])
        except Exception as e:
            raise MinferError(f"{checkpoint}: cannot get it from the hub or the local cache ({type(e).__name__})") from None
    if checkpoint in MODELS:  # a model minfer.fetch installs, by its name
        path = os.path.join(cache_dir(), MODELS[checkpoint].file)
        if not os.path.exists(path):
            raise MinferError(f"{checkpoint} is not installed; `python -m minfer.fetch {checkpoint}` installs it")
        return path
    raise MinferError(f"{checkpoint}: no such file or folder")


def load(checkpoint: str | None, dtype: torch.dtype, device, times: LoadTimes | None = None,
         dequantize: bool = False) -> tuple[ModelConfig, dict, tokenizer.Tokenizer]:
    """times, when given, accumulates where the load time went. GGUF matrices in a format with kernels
    stay quantized (quant.QuantizedWeight) unless `dequantize`."""
    device = torch.device(device)
    times = times or LoadTimes()
    times.device = device
    path = resolve(checkpoint)
    if os.path.isdir(path):
        return _load_hf_folder(path, dtype, device, times)
    with open_input(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path, dtype, device, times, dequantize)
    raise MinferError(f"{path}: not a GGUF file or an HF checkpoint folder")


def _load_gguf(path, dtype, device, times, dequantize):
    reader = gguf.open_reader(path)
    cfg = gguf.read_config(reader)
    tok = tokenizer.from_gguf(reader)
    weights = gguf.read_weights(reader, cfg, dtype, device, lambda xs: _progress(xs, "loading"), times,
                                keep_quantized=not dequantize)
    _check_complete(cfg, weights, path)
    return cfg, weights, tok


def _load_hf_folder(folder, dtype, device, times):
    from safetensors import safe_open

    hf_cfg = read_json(os.path.join(folder, "config.json"), missing_ok=True)
    if hf_cfg is None:
        raise MinferError(f"{folder}: no config.json (not an HF checkpoint folder)")
    cfg = ModelConfig.from_hf(hf_cfg)
    gen_path = os.path.join(folder, "generation_config.json")
    eos = (read_json(gen_path, missing_ok=True) or {}).get("eos_token_id")
    if eos is not None:
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(eos if isinstance(eos, list) else [eos]))

    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = read_json(index_path, missing_ok=True)
    if index is not None:
        if not isinstance(index.get("weight_map"), dict):
            raise MinferError(f"{index_path}: no weight_map")
        shards = sorted(set(index["weight_map"].values()))
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise MinferError(f"{folder}: no model.safetensors or model.safetensors.index.json")

    # HF's Gemma checkpoints store w of RMSNorm's x * (1 + w); the ops (and GGUF files) take 1 + w itself.
    norm_offset = 1.0 if cfg.arch == "gemma3" else 0.0
    weights = {}
    for shard in shards:
        shard_path = os.path.join(folder, shard)
        check_readable(shard_path)
        try:
            with safe_open(shard_path, framework="pt", device="cpu") as f:
                for name in _progress(list(f.keys()), f"loading {shard}"):
                    with times("read"):
                        w = f.get_tensor(name)
                    with times("upload"):
                        w = w.to(device)
                    with times("dequantize"):
                        if norm_offset and name.endswith("norm.weight"):
                            w = w.float() + norm_offset
                        weights[name] = w.to(dtype)
        except MinferError:
            raise
        except Exception as e:  # truncated or corrupt file
            raise MinferError(f"{shard_path}: cannot read safetensors ({type(e).__name__}: {e})") from None
    tok = tokenizer.from_hf_folder(folder, cfg.eos_token_ids, cfg.bos_token_id)
    _check_complete(cfg, weights, folder)
    return cfg, weights, tok


def _check_complete(cfg: ModelConfig, weights: dict, where: str) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        need += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight")]
        if cfg.attention_bias:
            need += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            need += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.sandwich_norm:
            need += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    missing = [n for n in need if n not in weights]
    if missing:
        raise MinferError(f"{where}: checkpoint is missing {len(missing)} tensors, e.g. {missing[0]}")
