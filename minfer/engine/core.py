"""The continuous-batching engine core: requests in, tokens out, one forward pass per step.

Front ends (LLM.generate, the CLI, a server) only call add_request / abort_request / step and read the
outputs. Each step the scheduler picks the sequences and token counts, the block manager has given them
pages, and the runner part of this file lays the step's tokens out flat (sequence after sequence), runs
the model over the paged cache, samples one token for every sequence whose tokens are all computed, and
applies the stop rules. A prompt scored alone (max_tokens 0, with prompt_logprobs) ends once it is prefilled,
with no token sampled: it may fill the whole context.

Async scheduling (on by default on a GPU): a step is launched before the sampled ids of the step before are
read, the input ids of its decodes gathered on the device from that step's (its prompt chunks' are on the
host); the host then reads those ids (the one sync a step) and applies them while the GPU runs the new step.
A sequence that the read ids end has its row of the new step discarded. A step that decodes a row with a
penalty (the penalties read the output ids on the host) waits for the ids first.
"""
from __future__ import annotations

import itertools
import operator
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..engine_args import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PAGE_SIZE
from ..errors import MinferError
from ..kv_cache import AttentionMetadata, PagedKVCache
from ..sampling import Logprobs, SamplingParams, SamplingTensors, sample_batch, upload, upload_packed
from ..structured import Matchers
from ..tokenizer import StreamDecoder
from .block_manager import BlockManager
from .graphs import try_decode_graphs, try_piece_graphs
from .loaded import LoadedModel
from .scheduler import POLICIES, ScheduledBatch, Scheduler
from .sequence import Sequence, Status
from .stats import Stats

# The engine's sizes at most: past these a step's own lists and tables, not the GPU, are what run out.
MAX_SEQS, MAX_STEP_TOKENS, MAX_PAGE_SIZE = 1 << 16, 1 << 20, 1 << 16
# Without --num-pages on the CPU: pages for max_num_seqs full contexts, but at most this many bytes.
CPU_CACHE_BYTES = 1 << 30


def _reasoning_ended(prompt_ids: list[int], tags: tuple[int, int]) -> bool:
    """Whether the prompt closes its last reasoning section: an end tag after the last start tag (a template that turns
    thinking off writes an empty section, Qwen3's)."""
    start, end = tags
    for t in reversed(prompt_ids):  # the last tag decides
        if t == end or t == start:
            return t == end
    return False


def step_metadata(work: list[tuple[list[int], int, list[int]]], page: int, sampled: list[int] | None,
                  with_ids: bool, local_tables: list[list[int]] | None, device: torch.device,
                  extra_rows: list[int] = ()):
    """The AttentionMetadata of a step's work (EngineCore._forward), its token ids [tokens] (with_ids; else
    None) and the rows whose logits are wanted [len(sampled) + len(extra_rows)]: each sampled sequence's last
    token, then the step's tokens extra_rows (prompt logprobs). Built in numpy: a step of 8192 tokens takes ~1.2 ms
    of host time against ~11 with Python lists, a 2000-page table ~0.4 against ~4 (perf/engine.md)."""
    n = len(work)
    counts = np.fromiter((len(t) for t, _, _ in work), np.int64, n)
    starts = np.fromiter((s for _, s, _ in work), np.int64, n)
    cu = np.zeros(n + 1, np.int64)  # [batch + 1]
    np.cumsum(counts, out=cu[1:])
    seq_lens = starts + counts  # [batch]
    row = np.repeat(np.arange(n), counts)  # [tokens]: each token's sequence
    positions = np.arange(cu[-1]) - cu[row] + starts[row]  # [tokens]

    def table_and_slots(tables):  # -> block_table [batch, max_pages] padded with 0, slot_mapping [tokens]
        table = np.zeros((n, max(map(len, tables))), np.int32)
        for i, pages in enumerate(tables):
            table[i, :len(pages)] = pages
        return table, table[row, positions // page].astype(np.int64) * page + positions % page

    table, slots = table_and_slots([pages for _, _, pages in work])
    logit_index = cu[1:] - 1 if sampled is None else cu[1:][np.asarray(sampled, np.int64)] - 1
    if len(extra_rows):
        logit_index = np.concatenate([logit_index, np.asarray(extra_rows, np.int64)])
    wide = [slots, logit_index]
    if with_ids:
        wide.append(np.fromiter(itertools.chain.from_iterable(t for t, _, _ in work), np.int64, int(cu[-1])))
    if local_tables is not None:
        local_table, local_slots = table_and_slots(local_tables)
        wide.append(local_slots)
    # leading decodes (one query each) before a prompt chunk: attention runs them apart (AttentionMetadata)
    chunks = np.flatnonzero(counts != 1)
    num_decodes = int(chunks[0]) if len(chunks) else 0
    narrow = [positions, seq_lens, cu, table] + ([local_table] if local_tables is not None else [])
    if num_decodes:
        narrow.append(cu[num_decodes:] - num_decodes)
    dev = upload_packed([a.astype(np.int32) for a in narrow] + [a.astype(np.int64) for a in wide], device)  # one copy
    (d_pos, d_lens, d_cu, d_table, *narrow_rest), (d_slots, d_logit_index, *rest) = dev[:len(narrow)], dev[len(narrow):]
    meta = AttentionMetadata(positions=d_pos, slot_mapping=d_slots, block_table=d_table, seq_lens=d_lens,
                             cu_seqlens_q=d_cu, max_seqlen_q=int(counts.max()), max_seqlen_k=int(seq_lens.max()))
    if local_tables is not None:
        meta.local_slot_mapping, meta.local_block_table = rest[-1], narrow_rest[0]
    if num_decodes:
        meta.num_decodes, meta.chunk_cu_seqlens_q = num_decodes, narrow_rest[-1]
        meta.decode_max_seqlen_k = int(seq_lens[:num_decodes].max())
        meta.chunk_max_seqlen_k = int(seq_lens[num_decodes:].max())
    return meta, rest[0] if with_ids else None, d_logit_index


@dataclass
class CompletionOutput:
    """One completion of a request, as vLLM's RequestOutput.outputs lists them."""
    index: int  # among the request's n (SamplingParams.n)
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the chosen tokens' logprobs, when logprobs were asked for
    logprobs: list[dict] | None
    finish_reason: str | None


class RequestOutput:
    """A request's state after a step: everything so far, and what this step added. The text of a request
    without stop strings is decoded when an output's text is first read: a front end that reads none (a
    benchmark) or only the last output's pays nothing a step. LLM.generate sets prompt (the text given, else
    None) and, for SamplingParams.n > 1, siblings: the n outputs of the prompt, this one first."""
    __slots__ = ("finished", "finish_reason", "num_cached_tokens", "prompt", "siblings", "_seq", "_n", "_added",
                 "_text", "_new_text")

    def __init__(self, seq: Sequence, added: bool, text: str | None = None, new_text: str | None = None):
        self.finished = seq.finish_reason is not None
        self.finish_reason = seq.finish_reason  # length | stop | abort
        self.num_cached_tokens = seq.num_cached_tokens  # prompt tokens found in the prefix cache
        self.prompt: str | None = None
        self.siblings: list[RequestOutput] | None = None
        self._seq, self._n, self._added = seq, len(seq.output_token_ids), added  # added: this step gave an id
        self._text, self._new_text = text, new_text

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's view of the request's completions: this one, or its n siblings."""
        def one(i, o):
            lps = o.logprobs
            return CompletionOutput(i, o.text, list(o.token_ids), None if lps is None else sum(e["logprob"] for e in lps),
                                    lps, o.finish_reason)
        return [one(i, o) for i, o in enumerate(self.siblings or [self])]

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._seq.prompt_ids

    @property
    def token_ids(self) -> list[int]:
        """Output ids so far (a stop id is not one of them): the sequence's own list, which grows until the
        request finishes (no copy a step)."""
        return self._seq.output_token_ids

    @property
    def logprobs(self) -> list[dict] | None:
        """Per output token: {"token_id", "logprob", "top": [(id, logprob), ...]}, when asked for."""
        return self._seq.logprobs if self._seq.params.logprobs is not None else None

    @property
    def prompt_logprobs(self) -> list[dict | None] | None:
        """Per prompt token, as logprobs' entries (the first token's None: nothing predicts it), when asked for;
        complete once the request has its first output token."""
        seq = self._seq
        return [None] + seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None

    @property
    def text(self) -> str:
        """Output text so far, cut before a stop string: the new_texts so far joined (with stop strings, a tail
        that may still begin one is not in it until the request finishes)."""
        if self._text is None:
            end = self._seq.decoded_length(self._n, self.finished)
            self._text = self._seq.text[:end]
        return self._text

    @property
    def new_text(self) -> str:
        """Text released by this step: text that may still begin a stop string is held back."""
        if self._new_text is None:
            seq, n = self._seq, self._n
            end = seq.decoded_length(n, self.finished)
            self._new_text = seq.text[seq.decoded_length(n - self._added):end]
        return self._new_text

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, text={self.text!r}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r})")


@dataclass
class _Launched:
    """A step whose forward and sampling are queued: its sampled ids on their way to the host."""
    seqs: list[Sequence]  # the sampled sequences, in row order
    ids: torch.Tensor  # [rows] int64 on the device: the next step's input ids, under async scheduling
    host: list[torch.Tensor]  # host copies (pinned on a GPU) of the ids, and of chosen, top, top_ids logprobs
    ready: torch.cuda.Event | None  # recorded after the copies (None on the CPU: they are done)


class EngineCore(LoadedModel):
    def __init__(self, checkpoint: str | None = None, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, long_prefill_token_threshold: int = 0,
                 num_pages: int | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                 gpu_memory_utilization: float = 0.9, prefix_caching: bool | None = None,
                 async_scheduling: bool | None = None, cuda_graph_sizes: list[int] | None = None,
                 prompt_graphs: bool = False, scheduling_policy: str = "fcfs", **load_kwargs):
        """long_prefill_token_threshold: a prompt's chunk in a step with decodes, at most (0: the step's budget;
        scheduler.py). async_scheduling: launch steps before reading the sampled ids of the step before
        (default: on a GPU, unless MINFER_NO_ASYNC=1). cuda_graph_sizes: the decode graphs' batch buckets, as
        vLLM's --cuda-graph-sizes (graphs.buckets_for; default 1, 2, 4, ... 256). load_kwargs: those of
        LoadedModel (dtype, device, backend, max_context, random_weights, dequantize). prefix_caching: reuse the
        pages of prompt prefixes seen before (default: on, but for models with sliding-window layers).
        prompt_graphs: CUDA graphs for steps that end a prompt beside few decodes (graphs.PieceGraphs), for a
        server, whose requests arrive one by one: ~2x sooner first tokens on the default model, for ~1 s of
        capture at start (H200), which a one-shot prompt or an offline batch (its prompts together) never wins
        back. scheduling_policy: fcfs, or priority (each request's priority, lower first; scheduler.py)."""
        if not 1 <= max_num_seqs <= MAX_SEQS:
            raise MinferError(f"--max-num-seqs must be in [1, {MAX_SEQS}], not {max_num_seqs}")
        if not 1 <= max_num_batched_tokens <= MAX_STEP_TOKENS:
            raise MinferError(f"--max-num-batched-tokens must be in [1, {MAX_STEP_TOKENS}], not {max_num_batched_tokens}")
        if not long_prefill_token_threshold >= 0:
            raise MinferError(f"--long-prefill-token-threshold must be at least 0, not {long_prefill_token_threshold}")
        if scheduling_policy not in POLICIES:
            raise MinferError(f"--scheduling-policy must be one of {', '.join(POLICIES)}, not {scheduling_policy!r}")
        if cuda_graph_sizes is not None and not (cuda_graph_sizes and min(cuda_graph_sizes) >= 1):
            raise MinferError(f"--cuda-graph-sizes must be sizes of at least 1, not {cuda_graph_sizes}")
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise MinferError(f"--block-size must be in [1, {MAX_PAGE_SIZE}], not {page_size}")
        if not 0 < gpu_memory_utilization <= 1:
            raise MinferError(f"--gpu-memory-utilization must be in (0, 1], not {gpu_memory_utilization}")
        if num_pages is not None and not num_pages >= 1:
            raise MinferError(f"--num-pages must be at least 1, not {num_pages}")
        super().__init__(checkpoint, **load_kwargs)
        self.max_num_batched_tokens = max_num_batched_tokens
        if page_size > max(self.max_context, 16):  # a page past one context only wastes memory
            raise MinferError(f"--block-size {page_size} is past the {self.max_context}-token context")
        if self.ops.name == "cuda" and page_size % 16:
            raise MinferError(f"--block-size {page_size}: the cuda backend needs a multiple of 16 (the attention "
                              f"kernels' key tile)")
        t0 = time.perf_counter()
        cfg = self.cfg
        # every running sequence decodes every step: no more of them than the step has tokens
        max_running = min(max_num_seqs, max_num_batched_tokens)
        # Two groups of layers when some attend in a window: the full ones, and the sliding ones (one window).
        sliding = [w is not None for w in self.model.windows]
        windows = set(self.model.windows) - {None}
        assert len(windows) <= 1, f"the sliding layers have several windows {sorted(windows)}"
        window = windows.pop() if windows else None
        local_pages = 0
        if window is not None:
            # The sliding pool: a window (and the page it may straddle) per running sequence, and a step's chunk.
            local_pages = max_running * (-(-window // page_size) + 1) + -(-max_num_batched_tokens // page_size)
            # A prefix hit would skip tokens whose sliding-layer keys are freed: no prefix caching, said where asked for.
            if prefix_caching:
                print("[minfer] prefix caching is off: the sliding-window layers keep only their window's keys",
                      file=sys.stderr)
            prefix_caching = False
        elif prefix_caching is None:
            prefix_caching = True
        kv = (page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        page_bytes = PagedKVCache.page_bytes(cfg.num_layers - sum(sliding), *kv)  # a page of each group
        local_page_bytes = PagedKVCache.page_bytes(sum(sliding), *kv)
        if num_pages is None:
            num_pages, local_pages = self._default_pages(page_bytes, local_page_bytes, local_pages, page_size,
                                                         max_num_seqs, max_num_batched_tokens, gpu_memory_utilization)
        elif self.device.type == "cuda":
            need = num_pages * page_bytes + (local_pages + 1) * local_page_bytes
            if need > torch.cuda.mem_get_info(self.device)[0]:
                raise MinferError(f"--num-pages {num_pages}: {need / 2**30:.2f} GiB of KV cache is more than the "
                                  f"GPU's free memory")
        # One page more in each group than the block manager hands out: the decode graphs' padding rows write
        # and read it, and the sliding group's freed entries point at it.
        try:
            self.cache = PagedKVCache(cfg.num_layers, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                                      self.dtype, self.device, sliding, local_pages + 1)
        except (RuntimeError, MemoryError):  # torch's OutOfMemoryError is a RuntimeError
            need = num_pages * page_bytes + (local_pages + 1) * local_page_bytes
            raise MinferError(f"--num-pages {num_pages}: {need / 2**30:.2f} GiB of KV cache does not fit in "
                              f"{self.device.type} memory") from None
        self.block_manager = BlockManager(num_pages, page_size, prefix_caching, window, local_pages)
        self.scheduler = Scheduler(self.block_manager, max_running, max_num_batched_tokens,
                                   long_prefill_token_threshold, scheduling_policy)
        self.graphs = try_decode_graphs(self, scratch_page=num_pages, max_num_seqs=max_running, sizes=cuda_graph_sizes)
        self.piece_graphs = try_piece_graphs(self, scratch_page=num_pages,
                                             max_num_batched_tokens=max_num_batched_tokens,
                                             chunk=long_prefill_token_threshold, prompts=prompt_graphs)
        self.seqs: dict[str, Sequence] = {}
        self.stop_ids = frozenset(self.tokenizer.stop_ids if self.tokenizer else ())
        self._matchers: Matchers | None = None  # structured outputs' tokenizer, built on first use
        self.reasoning_tags: tuple[int, int] | None = None  # a reasoning section's (start, end) ids: set_reasoning_tags
        if async_scheduling is None:
            async_scheduling = self.device.type == "cuda" and not os.environ.get("MINFER_NO_ASYNC")
        self.async_scheduling = async_scheduling
        if self.device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
            # The host's work a step is small copies and Python: torch's CPU threads only spin after each parallel op
            # and take the cores llguidance computes the masks on (60 rows of a JSON schema on a 16-core host: 2.5 ->
            # 0.7-0.9 ms a step). OMP_NUM_THREADS, where set, is kept (vLLM's rule for its GPU workers).
            torch.set_num_threads(1)
        self.in_flight: _Launched | None = None  # the launched step whose ids are not read yet
        self._ids = itertools.count()
        self.warm = False
        # (running sequences, CUDA event before the step's first GPU work, event after its last) per step, when
        # a list: the GPU's idle time between steps is the gap from one step's end to the next one's begin
        self.timeline: list | None = None
        self.last_step = (0, 0)
        self.load_s += time.perf_counter() - t0

    def _default_pages(self, page_bytes, local_page_bytes, local_pages, page_size, max_num_seqs,
                       max_num_batched_tokens, utilization) -> tuple[int, int]:
        """The pages of the full group and of the sliding group (which asks for local_pages), given the bytes of a
        page of each. On a GPU (vLLM's rule) the cache gets utilization x total memory, less what the weights and
        a forward of max_num_batched_tokens tokens (measured here) take: the sliding group first, as much as
        leaves one full context, the full group the rest. On the CPU the sliding group gets what it asks for, the
        full group max_num_seqs full contexts, at most what CPU_CACHE_BYTES leaves. At least one full context
        either way; a model without full layers (Mistral) gets max_num_seqs full contexts, which take no memory."""
        one_context = -(-self.max_context // page_size)
        most = max_num_seqs * one_context
        if self.device.type != "cuda":
            rest = CPU_CACHE_BYTES - (local_pages + 1) * local_page_bytes
            return max(one_context, min(most, rest // page_bytes if page_bytes else most)), local_pages
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        probe = PagedKVCache(self.cfg.num_layers, -(-max_num_batched_tokens // page_size), page_size,
                             self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype, self.device)
        tokens = min(max_num_batched_tokens, self.max_context)
        self._forward([(list(range(tokens)), 0, list(range(probe.num_pages)))], probe)
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before - probe.nbytes()
        del probe
        free, total = torch.cuda.mem_get_info(self.device)
        budget = utilization * total - (total - free) - activations
        if local_page_bytes:  # the sliding group first, but one full context stays (each less its scratch page)
            room = int((budget - (one_context + 1) * page_bytes) // local_page_bytes) - 1
            local_pages = max(0, min(local_pages, room))
        rest = budget - (local_pages + 1) * local_page_bytes
        pages = int(rest // page_bytes) - 1 if page_bytes else most
        if pages < one_context:
            raise MinferError(f"--gpu-memory-utilization {utilization}: room for {max(pages, 0)} KV pages of "
                              f"{page_size} tokens, fewer than one {self.max_context}-token context needs "
                              f"(raise it, or lower --max-context)")
        return pages, local_pages

    # ---- requests ----

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        return self.add_requests([(prompt_ids, params, request_id)], [priority])[0]

    def add_requests(self, requests: list[tuple[list[int], SamplingParams, str | None]],
                     priorities: list[int] | None = None) -> list[str]:
        """(prompt ids, params, request id or None) each, added all or none: every one is checked first, so that
        a bad one raises its MinferError before any other is queued (and prefilled). Returns their ids.
        priorities: each request's, lower first (with scheduling_policy priority; else all 0)."""
        priorities = self._check_priorities(priorities, len(requests))
        checked = [self._check_request(*r) for r in requests]
        given = [rid for _, _, rid in requests if rid is not None]
        if len(set(given)) != len(given):
            raise MinferError("a request id is given twice")
        # the structured outputs' matchers too, before any request is queued: building one checks its grammar
        matchers = [None if params.structured_outputs is None else self.matchers.matcher(params.structured_outputs)
                    for _, params, _ in requests]
        return [self._add(ids, params, rid, m, p)
                for ids, (_, params, rid), m, p in zip(checked, requests, matchers, priorities)]

    def _check_priorities(self, priorities: list[int] | None, n: int) -> list[int]:
        if priorities is None:
            return [0] * n
        if len(priorities) != n:
            raise MinferError(f"{n} requests and {len(priorities)} priorities")
        for p in priorities:
            if type(p) is not int:  # noqa: E721 (a bool is no priority)
                raise MinferError(f"priority must be an integer, not {p!r}")
        if any(priorities) and self.scheduler.policy != "priority":
            raise MinferError("priority: requests' priorities need --scheduling-policy priority (this engine's is "
                              f"{self.scheduler.policy})")
        return list(priorities)

    def _add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, matcher=None,
             priority: int = 0) -> str:
        if request_id is None:  # the next number no caller has taken as its own id
            request_id = next(i for i in map(str, self._ids) if i not in self.seqs)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq = Sequence(request_id, prompt_ids, params, min(params.max_tokens, self.max_context - len(prompt_ids)), seed,
                       priority=priority)
        seq.decoder = StreamDecoder(self.tokenizer) if self.tokenizer else None
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_ids)
        seq.penalized = (params.repetition_penalty != 1.0 or params.presence_penalty != 0
                         or params.frequency_penalty != 0)
        seq.matcher = matcher
        tags = self.reasoning_tags
        if matcher is not None and tags is not None and not _reasoning_ended(prompt_ids, tags):
            seq.reasoning_end = tags[1]
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        return request_id

    def _check_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> list[int]:
        """The request's ids as ints, or the MinferError that says what is wrong with it (but for its structured
        output's grammar: add_requests builds its matcher)."""
        self.check_params(params, grammar=False)
        try:
            prompt_ids = [operator.index(i) for i in prompt_ids]  # ints, numpy's too; no floats
        except TypeError:
            raise MinferError("prompt token ids must be integers") from None
        n = len(prompt_ids)
        if n == 0:
            raise MinferError("empty prompt")
        self.check_prompt_fits(n, min(params.max_tokens, 1))  # a prompt scored alone (max_tokens 0) may fill it
        vocab = self.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise MinferError(f"prompt token id out of range [0, {vocab})")
        if request_id is not None and request_id in self.seqs:
            raise MinferError(f"request id {request_id!r} is already in use")
        return prompt_ids

    def check_params(self, params: SamplingParams, grammar: bool = True) -> None:
        """The MinferError that says what is wrong with params for this model, if anything. grammar: build the
        structured output's matcher too, to check it."""
        if not isinstance(params, SamplingParams):
            raise MinferError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise MinferError(f"n = {params.n}: a request is one sequence here; LLM.generate makes n of them")
        if params.structured_outputs is not None and grammar:
            self.matchers.check(params.structured_outputs)
        vocab = self.cfg.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise MinferError(f"--logit-bias: token id {max(params.logit_bias)} out of range [0, {vocab})")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise MinferError(f"allowed_token_ids: token id {max(params.allowed_token_ids)} out of range [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None and getattr(params, name) > vocab:
                raise MinferError(f"{name} is {getattr(params, name)}, more than the vocabulary's {vocab} tokens")

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.status != Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Runs one forward pass; returns the requests that got a token (finished ones for the last time).
        Under async scheduling the tokens returned are the step before's, read while this one runs."""
        batch = self.scheduler.schedule()
        prev, self.in_flight = self.in_flight, None
        self.last_step = (len(batch), sum(batch.num_tokens))  # sequences and tokens, for the benchmarks
        # The batch runs before prev's ids are read: a row with a token in flight decodes the one prev sampled for it
        # (on the device), every other row's tokens are on the host. _launch reads prev's ids itself where its
        # sampling needs them on the host.
        launched, outputs = self._launch(batch, prev) if batch else (None, None)
        if prev is not None and outputs is None:
            outputs = self._apply(prev)
        if launched is not None and self.async_scheduling:
            self.in_flight = launched
        elif launched is not None:
            outputs = self._apply(launched)
        return (outputs or []) + self._finish_scored(batch.seqs)

    def _input_ids(self, seqs: list[Sequence], counts: list[int], prev: _Launched | None) -> torch.Tensor | None:
        """The step's input ids [tokens] on the device when some are prev's sampled ids (the rows with a token in
        flight: one each), else None (all on the host)."""
        fed = [i for i, s in enumerate(seqs) if s.in_flight] if prev is not None else []
        if not fed:
            return None
        row = {s: i for i, s in enumerate(prev.seqs)}
        if len(fed) == len(seqs):  # every row decodes: gathered from prev's, unless they are the same rows
            return prev.ids if seqs == prev.seqs else prev.ids[upload([row[s] for s in seqs], torch.int64, self.device)]
        chunks = (s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n] if not s.in_flight else [0]
                  for s, n in zip(seqs, counts))  # a placeholder at each fed row's token
        host = np.fromiter(itertools.chain.from_iterable(chunks), np.int64, sum(counts))
        starts = np.cumsum([0] + counts[:-1])
        index = np.asarray([starts[i] for i in fed] + [row[seqs[i]] for i in fed], np.int64)
        ids, index = upload_packed([host, index], self.device)  # one copy
        ids[index[:len(fed)]] = prev.ids[index[len(fed):]]
        return ids

    def _launch(self, batch: ScheduledBatch, prev: _Launched | None) -> tuple[_Launched | None, list | None]:
        """Queues the batch's forward pass and the sampling of its sequences whose tokens are all computed.
        prev: the step in flight, whose sampled ids are the input ids of this step's rows with a token in flight.
        Returns the launched step, and prev's outputs where it read them: a row with a penalty or a structured output
        samples from its output ids on the host (the penalties, the matcher's mask), so with such a row in flight
        prev's ids are read and applied after the forward is queued, while it runs, and before the sampling."""
        seqs, counts = batch.seqs, batch.num_tokens
        begin = self._event()
        ids = self._input_ids(seqs, counts, prev)  # None: all on the host
        local = [s.local_block_table for s in seqs] if self.block_manager.window is not None else None
        # the graphs keep no prompt token's logits, and sample every row (a prompt scored alone samples none)
        eager = any(s.wants_prompt_logprobs or not s.max_tokens for s in seqs)
        # the decode graphs feed each row its last token and sample every row: each row's one token must be its last
        # (a prompt's chunk of one token short of its end, under a tiny budget or a threshold of 1, runs eagerly)
        decodes = all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in zip(seqs, counts))
        if decodes and self.graphs is not None and self.graphs.fits(len(seqs)) and not eager:
            logits = self.graphs.run([s.token_ids[-1] for s in seqs] if ids is None else ids,
                                     [s.num_computed_tokens for s in seqs], [s.block_table for s in seqs],
                                     [s.slot for s in seqs], local)  # [len(seqs), vocab]: every row decodes
            sampled, chunks = seqs, []
        else:
            rows = [i for i, (s, n) in enumerate(zip(seqs, counts))
                    if s.num_computed_tokens + n == s.num_tokens and s.max_tokens]
            chunks = [s for s, n in zip(seqs, counts) if s.num_computed_tokens + n < s.num_tokens]
            # with ids on the device, a placeholder list gives each row's count
            work = [(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n] if ids is None else [0] * n,
                     s.num_computed_tokens, s.block_table) for s, n in zip(seqs, counts)]
            key = self.piece_graphs.key(counts, rows) if self.piece_graphs is not None and not eager else None
            if key is not None:  # decodes beside one prompt piece
                logits = self.piece_graphs.run(key, work, ids, local)  # [len(rows), vocab]
            else:
                extra, targets, spans = self._prompt_rows(seqs, counts)
                logits = self._forward(work, self.cache, rows, ids, local, extra)
                if extra:
                    self._prompt_logprobs(logits[len(rows):], targets, spans)
                    logits = logits[:len(rows)]
            sampled = [seqs[i] for i in rows]
        for s, n in zip(seqs, counts):
            s.num_computed_tokens += n
        for s in chunks:  # the pages prefill chunks filled (a sampled row's: when its id is applied)
            self.block_manager.register_full_pages(s)
        if not sampled:
            self._end_step(begin)
            return None, None
        applied = None
        if prev is not None and any(s.in_flight and (s.penalized or s.matcher is not None) for s in sampled):
            applied = self._apply(prev)  # rows it ended sample too, and their ids are discarded (_apply)
        t = SamplingTensors.build([s.params for s in sampled], [s.seed for s in sampled],
                                  [s.num_tokens for s in sampled], [s.prompt_ids for s in sampled],
                                  [s.output_ids for s in sampled], logits.shape[-1], self.device,
                                  self._banned(sampled), self._allowed(sampled))
        ids, logprobs = self._sample_rows(logits, t)
        for s in sampled:
            s.in_flight += 1
        host = [ids] if logprobs is None else [ids, logprobs.chosen, logprobs.top, logprobs.top_ids]
        host, ready = self._to_host(host)
        self._end_step(begin)
        return _Launched(sampled, ids, host, ready), applied

    def _apply(self, step: _Launched) -> list[RequestOutput]:
        """Reads a launched step's sampled ids (the step's one wait for the GPU) and applies each to its
        sequence: stop ids, stop strings, the length cap. A sequence that ended after the step was launched
        (stopped by the id before, or aborted) has its row discarded."""
        if step.ready is not None:
            step.ready.synchronize()
        toks = step.host[0].tolist()
        chosen, top, top_ids = (x.tolist() for x in step.host[1:]) if len(step.host) > 1 else (None,) * 3
        outputs, register = [], self.block_manager.register_full_pages
        for i, (seq, tok) in enumerate(zip(step.seqs, toks)):
            seq.in_flight -= 1
            if seq.status == Status.FINISHED:
                continue
            reason = None
            # a constraint offers the model's end-of-sequence ids only where its text is complete: they end it
            added = tok not in seq.stop_ids and not (seq.matcher is not None and tok in self.stop_ids)
            if added:
                seq.append(tok)
                k = seq.params.logprobs
                if k is not None:
                    seq.logprobs.append({"token_id": tok, "logprob": chosen[i],
                                         "top": list(zip(top_ids[i][:k], top[i][:k]))})
                if len(seq.output_token_ids) >= seq.max_tokens:
                    reason = "length"
            else:
                reason = "stop"
            if seq.reasoning_end is not None:  # a reasoning section, unconstrained: the grammar holds after its end
                if tok == seq.reasoning_end:
                    seq.reasoning_end = None
            elif seq.matcher is not None and added and not reason:
                # the mask allowed only ids the grammar takes; its end (nothing more to take) ends the request
                if not seq.matcher.consume_token(tok) or seq.matcher.is_stopped():
                    reason = "stop"
            register(seq)  # the pages its computed tokens filled, before a finish frees them
            text = new_text = None
            if seq.params.stop:
                reason, text, new_text = self._stop_strings(seq, tok if added else None, reason)
            if reason:
                self.scheduler.finish(seq, reason)
                del self.seqs[seq.request_id]
            outputs.append(RequestOutput(seq, added, text, new_text))
        return outputs

    def _finish_scored(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Ends the prompts scored alone (max_tokens 0) that the step prefilled to their end: their prompt logprobs
        are all in, and no token is sampled for them."""
        done = [s for s in seqs if not s.max_tokens and s.num_computed_tokens == s.num_tokens]
        for s in done:
            self.block_manager.register_full_pages(s)  # the pages its prompt filled, before the finish frees them
            self.scheduler.finish(s, "length")
            del self.seqs[s.request_id]
        return [RequestOutput(s, False) for s in done]

    def _stop_strings(self, seq: Sequence, tok: int | None, reason: str | None) -> tuple[str | None, str, str]:
        """A request with stop strings decodes every new id (tok; None: none was added) and cuts its text before
        the first stop string. Returns the finish reason, the text released so far, and the text this step
        releases: a tail that may still begin a stop string is held back until the request finishes."""
        stop = seq.params.stop
        new = seq.decoder.push(tok) if tok is not None and seq.decoder else ""
        if reason and seq.decoder:
            new += seq.decoder.flush()  # the request ends: what the decoder held back is text now
        if new:
            before, seq.text = len(seq.text), seq.text + new
            cut, length = -1, 0  # the first match; of two at one place, the longer
            for s in stop if seq.num_output_tokens >= seq.params.min_tokens else ():  # a match not found last step
                i = seq.text.find(s, max(0, before - len(s) + 1))  # ends in the new text
                if i >= 0 and (cut < 0 or (i, -len(s)) < (cut, -length)):
                    cut, length = i, len(s)
            if cut >= 0:
                seq.text, reason = seq.text[:cut + length if seq.params.include_stop_str_in_output else cut], "stop"
        hold = max(map(len, stop)) - 1
        end = len(seq.text) if reason else max(seq.emitted, len(seq.text) - hold)
        new_text, seq.emitted = seq.text[seq.emitted:end], max(seq.emitted, end)
        return reason, seq.text[:seq.emitted], new_text  # the held tail is no text yet: a stop string may cut it

    def _event(self):
        """A CUDA event recorded now, when the step timeline is kept (apps/bench_throughput.py), else None."""
        if self.timeline is None or self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _end_step(self, begin) -> None:
        """Closes the step's (sequences, first GPU work, last GPU work) entry of the timeline."""
        if begin is not None:
            self.timeline.append((self.last_step[0], begin, self._event()))

    def _forward(self, work: list[tuple[list[int], int, list[int]]], cache: PagedKVCache,
                 sampled: list[int] | None = None, ids: torch.Tensor | None = None,
                 local_tables: list[list[int]] | None = None, extra_rows: list[int] = ()) -> torch.Tensor:
        """work: per sequence (new token ids, position of the first, its pages). Returns the raw logits
        (Model.final_logits) of the last new token of the sequences in `sampled` (default: all), then of the step's
        tokens extra_rows. ids: the new tokens already on the device (async scheduling); work's lists then give only
        their counts. local_tables: per sequence its sliding group's pages (None: one group)."""
        meta, host_ids, logit_index = step_metadata(work, cache.page_size, sampled, ids is None, local_tables,
                                                    self.device, extra_rows)
        return self.model.forward_paged(host_ids if ids is None else ids, meta, cache, logit_index, raw_logits=True)

    def _allowed(self, sampled: list[Sequence]):
        """The ids each row's structured output allows next, packed (Matchers.bitmask; None: no row has one)."""
        if not any(s.matcher is not None for s in sampled):
            return None
        # a row ended by the ids just read (its matcher may be done) samples freely: its id is discarded; so does a
        # row still in its reasoning
        return self.matchers.bitmask([None if s.status == Status.FINISHED or s.reasoning_end is not None else s.matcher
                                      for s in sampled])

    def set_reasoning_tags(self, start: str, end: str) -> bool:
        """A reasoning model's tags (<think>, </think>): a constrained request whose prompt does not end its reasoning
        (no end tag after the last start tag) samples freely up to the end tag, and its structured output holds after
        it (vLLM's structured outputs with a reasoning parser). Each tag must be one token of the vocabulary: returns
        whether they are (if not, a constraint holds from the first token)."""
        # the vocabulary's own entry: encode would add a BOS (Llama's tokenizers) or a space prefix (SentencePiece's)
        ids = [self.tokenizer.tok.token_to_id(tag) if self.tokenizer else None for tag in (start, end)]
        self.reasoning_tags = None if None in ids else tuple(ids)
        return self.reasoning_tags is not None

    @property
    def matchers(self) -> Matchers:
        if self._matchers is None or self._matchers.tokenizer is not self.tokenizer:  # the server may set its own
            self._matchers = Matchers(self.tokenizer, self.cfg.vocab_size, sorted(self.stop_ids))
        return self._matchers

    @staticmethod
    def _banned(sampled: list[Sequence]) -> list | None:
        """Per row, the ids it may not draw: its stop ids until it has min_tokens (None: no row has a min_tokens)."""
        if not any(s.params.min_tokens for s in sampled):
            return None
        return [s.stop_ids if s.num_output_tokens + s.in_flight < s.params.min_tokens else () for s in sampled]

    @staticmethod
    def _prompt_rows(seqs: list[Sequence], counts: list[int]) -> tuple[list[int], list[int], list]:
        """The step's tokens whose logits give prompt logprobs not computed yet: their rows among the step's tokens,
        the prompt token each predicts, and per sequence (sequence, how many)."""
        rows, targets, spans, start = [], [], [], 0
        for s, n in zip(seqs, counts):
            if s.wants_prompt_logprobs:
                a = s.num_computed_tokens  # the chunk's first position (a recomputed prompt's rows are done)
                lo, hi = max(a, len(s.prompt_logprobs)), min(a + n, len(s.prompt_ids) - 1)
                if hi > lo:
                    rows += range(start + lo - a, start + hi - a)
                    targets += s.prompt_ids[lo + 1:hi + 1]
                    spans.append((s, hi - lo))
            start += n
        return rows, targets, spans

    def _prompt_logprobs(self, raw: torch.Tensor, targets: list[int], spans: list) -> None:
        """Appends each span's prompt logprobs (of the model's raw distribution, as the output's) from the
        lm_head's output [rows, vocab] at the rows that predict `targets`. Read back at once: only requests
        that ask for them wait for it."""
        lp = self.model.final_logits(raw).log_softmax(-1)  # [rows, vocab] fp32
        chosen = lp.gather(1, upload(targets, torch.int64, self.device)[:, None])[:, 0].tolist()
        k = max(s.params.prompt_logprobs for s, _ in spans)
        top, top_ids = (x.tolist() for x in lp.topk(k, dim=-1)) if k else ([[]] * len(targets),) * 2
        at = 0
        for s, n in spans:
            k = s.params.prompt_logprobs
            s.prompt_logprobs += [{"token_id": targets[j], "logprob": chosen[j],
                                   "top": list(zip(top_ids[j][:k], top[j][:k]))} for j in range(at, at + n)]
            at += n

    def _sample_rows(self, raw: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, Logprobs | None]:
        """ids [rows] from the lm_head's output [rows, vocab], read in the model's dtype where the logits are not
        soft-capped (the fp32 copy it spares was ~60 µs of the 8B shape's 7.3 ms step at 64 rows)."""
        if t.plain_greedy:
            return self.model.greedy_ids(raw), None
        capped = self.cfg.final_logit_softcapping is not None
        return sample_batch(self.model.final_logits(raw) if capped else raw, t, self.model.ops)

    # ---- offline batches ----

    def warmup(self) -> float:
        """One short request, so that first-call costs (lazy CUDA init, kernel loading, allocator growth) are
        paid before timing; the prefix cache forgets it. Returns the seconds it took; 0.0 once warm."""
        if self.warm:
            return 0.0
        t0 = time.perf_counter()
        bm = self.block_manager
        room = min(self.max_context, bm.num_pages * bm.page_size)  # positions one request can hold
        if room >= 2:  # up to 8 prompt tokens and 3 new ones, within a tiny context or page pool
            n_prompt = min(8, room - 1)
            self.add_request([0] * n_prompt, SamplingParams(temperature=0.0, max_tokens=min(3, room - n_prompt),
                                                            ignore_eos=True), "warmup")
        while self.has_unfinished():
            self.step()
        bm.reset_prefix_cache()
        bm.query_tokens = bm.hit_tokens = 0
        self.scheduler.num_preemptions = 0
        self._sync()
        self.warm = True
        return time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_output=None, priorities: list[int] | None = None) -> tuple[list[RequestOutput], Stats]:
        """Runs the prompts to completion. on_output(index, RequestOutput) is called after every step that
        gave request `index` a token. priorities: add_requests'."""
        if len(params) != len(prompts):
            raise MinferError(f"{len(prompts)} prompts and {len(params)} sampling params")
        if not prompts:
            return [], Stats()
        warmup_s = self.warmup()
        bm, sched = self.block_manager, self.scheduler
        hits0, preempt0 = bm.hit_tokens, sched.num_preemptions
        self._sync()
        t0 = time.perf_counter()
        index: dict[str, int] = {}  # request id -> prompt
        stats = Stats(prompt_tokens=sum(map(len, prompts)), warmup_s=warmup_s)
        results: list[RequestOutput | None] = [None] * len(prompts)
        first: dict[int, float] = {}
        t_decode = None  # when every request had its first token: the prefill phase's end
        try:
            rids = self.add_requests([(p, sp, None) for p, sp in zip(prompts, params)], priorities)  # all or none
            index.update((rid, i) for i, rid in enumerate(rids))
            while any(r is None or not r.finished for r in results):
                outs = self.step()
                if t_decode is not None:
                    stats.steps += self.last_step[0] > 0  # a forward pass ran
                    stats.decode_tokens += len(outs)
                stats.tokens += len(outs)
                now = time.perf_counter()
                for out in outs:
                    i = index[out.request_id]
                    first.setdefault(i, now)
                    results[i] = out
                    if on_output:
                        on_output(i, out)
                if t_decode is None and len(first) == len(prompts):
                    t_decode = now
        finally:  # an exception (a bad prompt, stdout closed, ^C) leaves no request behind
            for rid in list(self.seqs):
                if rid in index:
                    self.abort_request(rid)
        self._sync()
        end = time.perf_counter()
        stats.prefill_s = t_decode - t0
        stats.ttft_s = sum(first.values()) / len(first) - t0
        stats.decode_s = end - t_decode
        stats.cached_tokens = bm.hit_tokens - hits0
        stats.preemptions = sched.num_preemptions - preempt0
        return results, stats

