"""The static-batch engine: one padded batch of prompts, prefill + decode loop + stop handling, over a dense
KV cache. It is the baseline of apps/bench_throughput.py --static and runs apps/bench_e2e.py's fixed-batch
steps on the dense kernels; the continuous-batching engine is core.py.

The engine owns one KV cache, grown on demand to the largest batch and context asked for, and one decode
step per batch size over it (on the cuda backend a captured CUDA graph). Both are made by warmup(),
before any timing starts, and reused by later generate() calls.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from ..errors import MinferError
from ..kv_cache import KVCache
from ..ops import DENSE_OPS
from ..sampling import SamplingParams, make_generator, sample
from ..tokenizer import StreamDecoder
from .graphs import capture_failed
from .loaded import LoadedModel
from .stats import Stats


@dataclass
class DecodeStep:
    """One decode step of a batch: run() takes the tokens in `ids` [batch] at positions `pos` [batch] (its own
    buffers: fill them in place) and returns the lm_head's output [batch, vocab] (raw logits: Model.final_logits;
    valid until the next run), advancing `pos` by one, clamped to the cache's last row. The advance is in the step's
    graph: no launches of its own."""
    ids: torch.Tensor
    pos: torch.Tensor
    run: callable


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # length | stop


class Engine(LoadedModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache: KVCache | None = None  # [max batch, capacity], grown by _cache_rows
        self.steps: dict[int, DecodeStep] = {}  # batch -> decode step over the cache's first `batch` rows
        self.warm: set[tuple] = set()  # warmup() keys: batch, prompt length, sampling switches

    def _cache_rows(self, batch: int, capacity: int) -> KVCache:
        """The first `batch` rows of the engine's KV cache, grown first if it is too small. Batch and capacity
        never shrink; capacity grows in steps of 256, so that a run of longer prompts reallocates rarely.
        Growing drops the decode steps, whose graphs point into the old cache."""
        old = self.cache
        if old is None or old.batch < batch or old.capacity < capacity:
            batch_all = max(batch, old.batch if old else 0)
            capacity = min(self.max_context, max(-(-capacity // 256) * 256, old.capacity if old else 0))
            self.cache, self.steps = None, {}  # free the old memory first
            cfg = self.cfg
            self.cache = KVCache(cfg.num_layers, batch_all, capacity, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                                 self.device)
        return self.cache.rows(batch)

    @torch.inference_mode()
    def warmup(self, batch: int = 1, prompt_len: int = 8, capacity: int | None = None,
               params: SamplingParams | None = None) -> float:
        """Readies generate() for `batch` prompts padded to `prompt_len` tokens, `capacity` positions a
        sequence, sampled like `params`: sizes the KV cache, makes the decode step (a captured CUDA graph on
        the cuda backend) and runs three tokens of such a generation, so that every first-call cost (lazy
        CUDA init, kernel loading, a graph's first replay, allocator growth) is paid here. Returns the
        seconds it took; 0.0 when it was already done."""
        params = params or SamplingParams(temperature=0.0)
        capacity = min(self.max_context, max(capacity or 0, prompt_len + 3))
        key = (batch, prompt_len, params.temperature > 0, params.top_k > 0, params.top_p < 1, params.min_p > 0,
               params.repetition_penalty != 1)
        old = self.cache
        if key in self.warm and batch in self.steps and old.batch >= batch and old.capacity >= capacity:
            return 0.0
        t0 = time.perf_counter()
        cache = self._cache_rows(batch, capacity)
        if batch not in self.steps:
            self.steps[batch] = self._decode_step(cache, batch)
        self._generate([[0] * prompt_len] * batch, params, [3] * batch, cache, [], None, set())
        self.warm.add(key)
        return time.perf_counter() - t0

    def _decode_step(self, cache: KVCache, batch: int) -> DecodeStep:
        """The decode step over `cache`'s first `batch` rows, run once here.

        On the cuda backend with no ref fallbacks among the dense ops the step is captured once in a CUDA graph: a decode
        step at batch 1 is ~30 layers x 10 small launches, and replaying them as one graph removes the
        CPU launch cost that otherwise dominates. MINFER_NO_GRAPH=1 turns this off."""
        ids = torch.zeros(batch, dtype=torch.int64, device=self.device)  # [batch]
        pos = torch.zeros(batch, dtype=torch.int32, device=self.device)  # [batch]; writes position 0, rewritten later
        last = cache.capacity - 1

        def eager():
            logits = self.model.forward(ids[:, None], pos, cache, raw_logits=True)[:, 0]
            # Finished sequences keep stepping (the batch's shape is fixed); they rewrite their own last cache
            # row instead of running past the cache.
            pos.add_(1).clamp_(max=last)
            return logits

        dense_fallbacks = set(self.ops.fallbacks) & set(DENSE_OPS)
        if self.ops.name != "cuda" or dense_fallbacks or os.environ.get("MINFER_NO_GRAPH"):
            eager()  # the first call's costs, outside any timing
            return DecodeStep(ids, pos, eager)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up outside capture: lazy init, workspace allocation
                eager()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = eager()
        except RuntimeError as e:
            capture_failed(e, "decoding eagerly")
            return DecodeStep(ids, pos, eager)

        def replay():
            graph.replay()
            return logits  # overwritten by the next replay

        return DecodeStep(ids, pos, replay)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                 stop: list[str] | None = None, on_text=None, ignore_eos: bool = False) -> tuple[list[Output], Stats]:
        """prompts: token ids per sequence. on_text(seq_index, text_delta) is called as text decodes.
        ignore_eos: the model's end-of-sequence ids do not stop a sequence (stop strings still do)."""
        stop = stop or []
        if "" in stop:
            raise MinferError("empty stop string: it would match before the first token")
        unread = [name for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("logprobs", None),
                                         ("logit_bias", {}), ("stop_token_ids", []), ("prompt_logprobs", None), ("min_tokens", 0),
                                         ("n", 1), ("structured_outputs", None))
                  if getattr(params, name) != off]
        if unread:  # sample() reads one SamplingParams' temperature, filters, repetition penalty and seed
            raise MinferError(f"the static engine does not apply {', '.join(unread)}: the continuous engine does")
        batch, lens = len(prompts), [len(p) for p in prompts]
        if batch == 0 or min(lens) == 0:
            raise MinferError("empty prompt")
        longest = max(lens)
        self.check_prompt_fits(longest)
        # Each sequence may grow to the context's end, whatever the other prompts' lengths.
        caps = [min(max_new_tokens, self.max_context - n) for n in lens]
        capacity = max(n + c for n, c in zip(lens, caps))
        warmup_s = self.warmup(batch, longest, capacity, params)
        stop_ids = set() if ignore_eos or not self.tokenizer else set(self.tokenizer.stop_ids)
        outputs, stats = self._generate(prompts, params, caps, self._cache_rows(batch, capacity), stop, on_text,
                                        stop_ids)
        stats.warmup_s = warmup_s
        return outputs, stats

    def _next_ids(self, raw: torch.Tensor, params: SamplingParams, generator, seen) -> torch.Tensor:
        """[batch] ids from the lm_head's output [batch, vocab]: greedy with no penalty takes Model.greedy_ids."""
        if params.temperature <= 0.0 and seen is None:
            return self.model.greedy_ids(raw)
        return sample(self.model.final_logits(raw), params, generator, seen)

    def _generate(self, prompts, params, caps, cache, stop, on_text, stop_ids) -> tuple[list[Output], Stats]:
        """The timed part of generate(): caps[b] tokens at most for prompt b, over `cache` (batch rows)."""
        batch, lens, longest, dev = len(prompts), [len(p) for p in prompts], max(map(len, prompts)), self.device
        decode_step, generator = self.steps[batch], make_generator(params.seed, self.device)
        stats = Stats(prompt_tokens=sum(lens))
        self._sync()
        t0 = time.perf_counter()
        # Right-padded with each prompt's first id: padding rows are never read, and the repetition
        # penalty's seen-set below gets no id that the prompt does not hold.
        ids = torch.tensor([p + p[:1] * (longest - len(p)) for p in prompts], device=dev)  # [batch, longest]
        start = torch.zeros(batch, dtype=torch.int32, device=dev)
        last = torch.tensor([n - 1 for n in lens], device=dev)
        logits = self.model.forward(ids, start, cache, logit_index=last, raw_logits=True)  # [batch, vocab]
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=dev)  # [batch, vocab]
            seen.scatter_(1, ids, True)
        next_ids = self._next_ids(logits, params, generator, seen)  # [batch]
        decode_step.pos.copy_(torch.tensor(lens, dtype=torch.int32))  # [batch] position of next_ids

        outputs = [Output() for _ in range(batch)]
        decoders = [StreamDecoder(self.tokenizer) for _ in range(batch)] if self.tokenizer else None
        emitted, done = [0] * batch, [False] * batch
        hold = max((len(s) for s in stop), default=1) - 1  # text that may still become a stop string
        t_decode = t0
        steps = max(caps)
        for step in range(steps):
            ids_now = next_ids  # [batch], this step's tokens
            (host,), ready = self._to_host([ids_now])
            # The next step goes in before this one's tokens are read: the GPU decodes while the host applies them
            # (stop ids and strings, detokenizing). A batch that then turns out finished wastes that one step, which
            # the stats leave out.
            if step + 1 < steps:
                if seen is not None:
                    seen.scatter_(1, ids_now[:, None], True)
                decode_step.ids.copy_(ids_now)
                logits = decode_step.run()  # [batch, vocab]
                next_ids = self._next_ids(logits, params, generator, seen)
            if ready is not None:
                ready.synchronize()
            host_ids = host.tolist()
            if step == 0:
                stats.ttft_s = stats.prefill_s = time.perf_counter() - t0
                t_decode = time.perf_counter()
            else:
                stats.steps += 1  # the decode step that made these tokens
            for b, tok in enumerate(host_ids):
                if done[b]:
                    continue
                out = outputs[b]
                stats.tokens += 1
                if tok in stop_ids:
                    out.finish_reason, done[b] = "stop", True
                else:
                    out.token_ids.append(tok)
                    out.text += decoders[b].push(tok) if decoders else ""
                done[b] = done[b] or step + 1 == caps[b]  # finish_reason stays "length"
                if done[b] and decoders:
                    out.text += decoders[b].flush()  # the row ends: what its decoder held back is text now
                cut = min((i for i in (out.text.find(s) for s in stop) if i >= 0), default=-1)
                if cut >= 0:
                    out.text, out.finish_reason, done[b] = out.text[:cut], "stop", True
                end = len(out.text) if done[b] else max(emitted[b], len(out.text) - hold)
                if on_text and end > emitted[b]:
                    on_text(b, out.text[emitted[b]:end])
                emitted[b] = end
            t_last = time.perf_counter()
            if all(done):
                break
        self._sync()
        stats.decode_s = t_last - t_decode
        stats.decode_tokens = stats.tokens - batch
        return outputs, stats
