"""The engine: load once, then prefill + decode loop + stop handling for a batch of prompts."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch

from . import loader
from .errors import MinferError
from .kv_cache import KVCache
from .model import Transformer
from .ops import get_backend
from .sampling import SamplingParams, make_generator, sample
from .tokenizer import StreamDecoder


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0  # prompt in -> first token on the host
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens
        return steps / self.decode_s if self.decode_s else 0.0


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # length | stop


class Engine:
    def __init__(self, checkpoint: str | None = None, dtype: torch.dtype | None = None, device: str | None = None,
                 backend: str = "auto", max_context: int | None = None):
        t0 = time.perf_counter()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise MinferError("--device cuda asked for, but no CUDA GPU is visible")
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.ops = get_backend(backend, self.device)
        if self.ops.name == "cuda" and self.device.type != "cuda":
            raise MinferError("--backend cuda needs --device cuda")
        self.cfg, weights, self.tokenizer = loader.load(checkpoint, self.dtype, self.device)
        limit = self.cfg.max_position_embeddings
        if self.cfg.sliding_window:
            limit = min(limit, self.cfg.sliding_window)  # full attention is exact only inside the window
        self.max_context = min(max_context or limit, limit)
        self.model = Transformer(self.cfg, weights, self.ops, self.max_context)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.load_s = time.perf_counter() - t0

    def encode(self, text: str, chat: bool, system: str | None = None) -> list[int]:
        if not chat:
            return self.tokenizer.encode(text)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return self.tokenizer.encode_chat(messages)

    def _decode_step(self, cache: KVCache, next_ids: torch.Tensor, pos: torch.Tensor):
        """A function (ids [batch], pos [batch]) -> logits [batch, vocab] for one decode step.

        On the cuda backend with no ref fallbacks the step is captured once in a CUDA graph: a decode
        step at batch 1 is ~30 layers x 10 small launches, and replaying them as one graph removes the
        CPU launch cost that otherwise dominates. MINFER_NO_GRAPH=1 turns this off."""
        def eager(ids, p):
            return self.model.forward(ids[:, None], p, cache)[:, 0]

        if self.ops.name != "cuda" or self.ops.fallbacks or os.environ.get("MINFER_NO_GRAPH"):
            return eager
        static_ids, static_pos = next_ids.clone(), pos.clone()
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up outside capture: lazy init, workspace allocation
                eager(static_ids, static_pos)  # writes only position `pos`, which the real step rewrites
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = eager(static_ids, static_pos)
        except RuntimeError as e:
            print(f"[minfer] CUDA graph capture failed ({str(e).splitlines()[0]}); decoding eagerly", file=sys.stderr)
            return eager

        def replay(ids, p):
            static_ids.copy_(ids)
            static_pos.copy_(p)
            graph.replay()
            return static_logits

        return replay

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                 stop: list[str] | None = None, on_text=None) -> tuple[list[Output], Stats]:
        """prompts: token ids per sequence. on_text(seq_index, text_delta) is called as text decodes."""
        stop = stop or []
        batch, lens = len(prompts), [len(p) for p in prompts]
        longest = max(lens)
        if min(lens) == 0:
            raise MinferError("empty prompt")
        if longest >= self.max_context:
            raise MinferError(f"prompt is {longest} tokens; the context is {self.max_context} (see --max-context)")
        max_new_tokens = min(max_new_tokens, self.max_context - longest)
        dev = self.device
        cache = KVCache(self.cfg.num_layers, batch, longest + max_new_tokens, self.cfg.num_kv_heads,
                        self.cfg.head_dim, self.dtype, dev)
        generator = make_generator(params.seed, dev)
        stats = Stats(prompt_tokens=sum(lens))
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda *a: None)

        sync()
        t0 = time.perf_counter()
        ids = torch.zeros(batch, longest, dtype=torch.int64)  # right-padded; padding rows are never read
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        start = torch.zeros(batch, dtype=torch.int32, device=dev)
        last = torch.tensor([n - 1 for n in lens], device=dev)
        logits = self.model.forward(ids, start, cache, logit_index=last)  # [batch, vocab]
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=dev)
            seen.scatter_(1, ids, True)
        next_ids = sample(logits, params, generator, seen)  # [batch]
        pos = torch.tensor(lens, dtype=torch.int32, device=dev)  # position of next_ids

        outputs = [Output() for _ in range(batch)]
        decoders = [StreamDecoder(self.tokenizer) for _ in range(batch)]
        emitted = [0] * batch
        hold = max((len(s) for s in stop), default=1) - 1  # text that may still become a stop string
        done = [False] * batch
        stop_ids = set(self.tokenizer.stop_ids)
        t_decode = None
        for step in range(max_new_tokens):
            host_ids = next_ids.tolist()
            if step == 0:
                stats.ttft_s = stats.prefill_s = time.perf_counter() - t0
                t_decode = time.perf_counter()
                decode_step = self._decode_step(cache, next_ids, pos)  # graph capture counts as decode time
            for b, tok in enumerate(host_ids):
                if done[b]:
                    continue
                out = outputs[b]
                if tok in stop_ids:
                    out.finish_reason, done[b] = "stop", True
                else:
                    out.token_ids.append(tok)
                    out.text += decoders[b].push(tok)
                cut = min((i for i in (out.text.find(s) for s in stop) if i >= 0), default=-1)
                if cut >= 0:
                    out.text, out.finish_reason, done[b] = out.text[:cut], "stop", True
                end = len(out.text) if done[b] else max(emitted[b], len(out.text) - hold)
                if on_text and end > emitted[b]:
                    on_text(b, out.text[emitted[b]:end])
                emitted[b] = end
            if all(done) or step == max_new_tokens - 1:
                break
            if seen is not None:
                seen.scatter_(1, next_ids[:, None], True)
            logits = decode_step(next_ids, pos)  # [batch, vocab]
            pos += 1
            next_ids = sample(logits, params, generator, seen)
        for b, out in enumerate(outputs):
            if on_text and len(out.text) > emitted[b]:
                on_text(b, out.text[emitted[b]:])
        sync()
        if t_decode is not None:
            stats.decode_s = time.perf_counter() - t_decode
        # Tokens produced by decode steps (the first came from prefill).
        stats.generated_tokens = sum(max(0, len(o.token_ids) + (o.finish_reason == "stop") - 1) for o in outputs)
        return outputs, stats


def print_stats(engine: Engine, stats: Stats, file=sys.stderr) -> None:
    print(f"[minfer] load {engine.load_s:.2f} s | backend {engine.ops.name} {str(engine.dtype).replace('torch.', '')} "
          f"on {engine.device} | prompt {stats.prompt_tokens} tok | ttft {stats.ttft_s * 1000:.1f} ms | "
          f"prefill {stats.prefill_tok_s:.1f} tok/s | decode {stats.decode_tok_s:.1f} tok/s", file=file)
