"""Logits -> next token ids, entirely on the device (no host sync).

sample() serves the static engine: one SamplingParams for the whole batch and a torch.Generator.
sample_batch() serves the continuous engine: every row has its own parameters (SamplingTensors), and its
randomness is a hash of (seed, position, token id), so a seeded request draws the same tokens alone or in
any batch, and again after it is preempted and recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import MinferError
from .ops import reference
from .structured import KINDS, StructuredOutputs

# The smallest temperature above 0: below it logits / temperature overflow fp32 to inf, and the
# probabilities become NaN. Use 0 for greedy.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 0.7  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; divides the logits of prompt and output ids (HF's rule)
    seed: int | None = None
    max_tokens: int = 16  # new tokens at most (as the context allows); 0, with prompt_logprobs: the prompt scored alone
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after it instead
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's end-of-sequence ids
    ignore_eos: bool = False  # the model's end-of-sequence ids do not stop (stop_token_ids still do)
    presence_penalty: float = 0.0  # subtracted from the logits of ids in the output so far (OpenAI's rule)
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output so far
    logprobs: int | None = None  # per token: the chosen id's log-probability and the top-n (0: chosen only)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI's)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be drawn
    prompt_logprobs: int | None = None  # per prompt token after the first: its log-probability and the top-n
    min_tokens: int = 0  # new tokens before a stop id or stop string may end the output (vLLM's)
    n: int = 1  # LLM.generate's completions of each prompt (seeds seed, seed + 1, ... when seeded)
    structured_outputs: StructuredOutputs | dict | None = None  # a JSON schema, regex, choice or grammar (structured.py)

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string, as vLLM takes it
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError:
                raise MinferError(f"structured_outputs takes {', '.join(KINDS)}, not "
                                  f"{sorted(self.structured_outputs)}") from None
        self.validate()

    def validate(self) -> None:
        """One check per parameter, named by its CLI flag. Each accepts only good values, as NaN fails every
        comparison (a check that rejects bad values would let NaN through); the engine checks again at
        add_request, so that a field changed after construction is checked too. Values run in fp32: a
        temperature or penalty past its range there would be inf or 0."""
        t = self.temperature
        if not (_number(t) and (t == 0 or MIN_TEMPERATURE <= t <= FP32_MAX)):
            raise MinferError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, not {t!r}")
        if not (_integer(self.top_k) and self.top_k >= 0):
            raise MinferError(f"--top-k must be an integer >= 0 (0 = off), not {self.top_k!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise MinferError(f"--top-p must be in (0, 1], not {self.top_p!r}")
        if not (_number(self.min_p) and 0 <= self.min_p < 1):
            raise MinferError(f"--min-p must be in [0, 1), not {self.min_p!r}")
        if not (_number(self.repetition_penalty) and FP32_TINY <= self.repetition_penalty <= FP32_MAX):
            raise MinferError(f"--repetition-penalty must be a number > 0 that fp32 holds, not {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (_number(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                raise MinferError(f"--{name.replace('_', '-')} must be in [-2, 2], not {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise MinferError(f"structured_outputs must be a StructuredOutputs, not "
                                  f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.kind()
        if not (_integer(self.n) and self.n >= 1):
            raise MinferError(f"n must be an integer >= 1, not {self.n!r}")
        if self.seed is not None and not (_integer(self.seed) and 0 <= self.seed < 2**63):
            raise MinferError(f"--seed must be an integer in [0, 2^63), not {self.seed!r}")
        scored = self.max_tokens == 0 and self.prompt_logprobs is not None  # the prompt's logprobs, no new token
        if not (_integer(self.max_tokens) and (self.max_tokens >= 1 or scored)):
            raise MinferError(f"max_tokens (--max-new-tokens) must be at least 1 (0 only with prompt_logprobs), not "
                              f"{self.max_tokens!r}")
        if not (_integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise MinferError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], not "
                              f"{self.min_tokens!r}")
        if not (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop)):
            raise MinferError(f"stop must be a string or a list of strings, not {self.stop!r}")
        if "" in self.stop:
            raise MinferError("empty stop string: it would match before the first token")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise MinferError(f"include_stop_str_in_output must be true or false, not {self.include_stop_str_in_output!r}")
        if not (isinstance(self.stop_token_ids, (list, tuple)) and all(_integer(i) for i in self.stop_token_ids)):
            raise MinferError(f"stop_token_ids must be a list of token ids, not {self.stop_token_ids!r}")
        if self.logprobs is not None and not (_integer(self.logprobs) and self.logprobs >= 0):
            raise MinferError(f"logprobs must be an integer >= 0, not {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (_integer(self.prompt_logprobs) and self.prompt_logprobs >= 0):
            raise MinferError(f"prompt_logprobs must be an integer >= 0, not {self.prompt_logprobs!r}")
        if not isinstance(self.logit_bias, dict):
            raise MinferError(f"--logit-bias must be a dict of token id -> bias, not {type(self.logit_bias).__name__}")
        for i, b in self.logit_bias.items():
            if not (_integer(i) and i >= 0 and _number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
                raise MinferError(f"--logit-bias maps token ids (integers >= 0) to numbers in [-{MAX_LOGIT_BIAS}, "
                                  f"{MAX_LOGIT_BIAS}], not {i!r}: {b!r}")
        ids = self.allowed_token_ids
        if ids is not None and not (isinstance(ids, (list, tuple)) and ids and all(_integer(i) and i >= 0 for i in ids)):
            raise MinferError(f"allowed_token_ids must be a non-empty list of token ids, not {ids!r}")


FP32_TINY, FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
MAX_LOGIT_BIAS = 100  # OpenAI's range: -100 bans a token in effect, 100 all but forces it


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [batch, vocab] fp32; seen [batch, vocab] bool (ids in the prompt or generated so far).
    Seen logits are divided by the penalty when positive and multiplied when negative."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Masks (to -inf) every token outside the top-k / top-p nucleus / min-p floor. logits [batch, vocab]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token while the mass before it is below top_p: the smallest set reaching top_p.
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False  # the most likely token always stays (a top_p that is 0 in fp32 keeps it)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits [batch, vocab] fp32 -> ids [batch] int64, on the logits' device."""
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.temperature <= 0.0:
        return logits.argmax(-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    probs = logits.softmax(-1)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, with no host sync.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(-1)


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# ---- per-row sampling (the continuous engine) ----

def upload(values, dtype, device) -> torch.Tensor:
    """A host list as a device tensor (numpy arrays: upload_packed). On a GPU through pinned memory without a sync: a
    copy from pageable memory waits for the stream, and the GPU would idle while the host prepares the next step."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


# Fields of a packed upload start on multiples of this many bytes.
ALIGN = 256


def upload_packed(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """Host arrays (any dtypes) as device tensors of their shapes and dtypes, through one copy of their bytes (from
    pinned memory, without a sync, on a GPU): a step's metadata travels in one copy instead of one a field."""
    device = torch.device(device)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets = np.cumsum([0] + [-(-a.nbytes // ALIGN) * ALIGN for a in arrays])
    host = torch.empty(int(offsets[-1]), dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = host.numpy()
    for a, o in zip(arrays, offsets):
        buf[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return [dev[o:o + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, o in zip(arrays, offsets)]


@dataclass
class SamplingTensors:
    """Every row's sampling parameters as tensors on the device, and host flags that skip unused work."""
    # None where no row uses them: the draw's when every row is greedy, the penalties' when none has one
    temperature: torch.Tensor | None  # [batch] fp32: each row's, 0 where the row is greedy
    top_k: torch.Tensor | None  # [batch] int64, vocab = off
    top_p: torch.Tensor | None  # [batch] fp32
    min_p: torch.Tensor | None  # [batch] fp32
    repetition_penalty: torch.Tensor | None  # [batch] fp32
    presence_penalty: torch.Tensor | None  # [batch] fp32
    frequency_penalty: torch.Tensor | None  # [batch] fp32
    seeds: torch.Tensor | None  # [batch] int64
    positions: torch.Tensor | None  # [batch] int64: the position of the token being drawn (the RNG's counter)
    seen: torch.Tensor | None  # [batch, vocab] bool: prompt and output ids (for the repetition penalty)
    counts: torch.Tensor | None  # [batch, vocab] fp32: output id counts (presence / frequency penalties)
    logit_bias: torch.Tensor | None  # [batch, vocab] fp32: added to the logits before anything else (-inf: banned)
    allowed: torch.Tensor | None  # [batch, ceil(vocab / 32)] int32: the ids structured outputs and allowed_token_ids
    # allow, id 32 w + b as bit b of word w (the rest -inf after the bias: apply_token_bitmask)
    all_greedy: bool
    filtered: bool  # some drawn row uses top-k, top-p or min-p
    num_logprobs: int | None  # the largest top-n asked for; None: no row wants logprobs

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, with no penalty, no logit bias and no logprobs: the ids are the logits' argmax."""
        return (self.all_greedy and self.seen is None and self.counts is None and self.logit_bias is None
                and self.allowed is None and self.num_logprobs is None)

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int], prompts: list[list[int]],
              outputs: list[list[int]], vocab: int, device, banned: list | None = None,
              allowed=None) -> "SamplingTensors":
        """The tensors a batch needs, and only those: an all-greedy batch without penalties needs none.
        banned: per row, ids it may not draw (a stop id before min_tokens); allowed: the ids each row may draw
        (structured outputs: Matchers.bitmask's [batch, ceil(vocab / 32)] int32 numpy), or None; a row's
        allowed_token_ids narrow it further."""
        def col(values, dtype=torch.float32):
            return upload(values, dtype, device)

        batch = len(params)
        seen = counts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            ids = [p + o for p, o in zip(prompts, outputs)]
            width = max(map(len, ids))  # rows padded with their own first id
            seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
            seen.scatter_(1, col([i + i[:1] * (width - len(i)) for i in ids], torch.int64), True)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            width = max(1, max(map(len, outputs)))
            padded = col([o + [0] * (width - len(o)) for o in outputs], torch.int64)  # [batch, width]
            ones = col([[1.0] * len(o) + [0.0] * (width - len(o)) for o in outputs])
            counts = torch.zeros(batch, vocab, device=device).scatter_add_(1, padded, ones)
        bias = None
        entries = {(row, i): b for row, p in enumerate(params) for i, b in p.logit_bias.items()}
        entries.update(((row, i), float("-inf")) for row, ids in enumerate(banned or ()) for i in ids)  # -inf wins
        if entries:
            bias = torch.zeros(batch, vocab, device=device)
            (rows, ids), values = zip(*entries), list(entries.values())
            bias.index_put_((col(rows, torch.int64), col(ids, torch.int64)), col(values))
        if any(p.allowed_token_ids is not None for p in params):
            only = pack_ids([p.allowed_token_ids for p in params], vocab)
            allowed = only if allowed is None else allowed & only
        allowed = None if allowed is None else upload_packed([allowed], device)[0]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        is_greedy = [p.temperature == 0 for p in params]
        greedy = all(is_greedy)
        drawn = None
        if not greedy:  # what the random draw reads, in one copy
            # a greedy row's filters off: its ids do not depend on the batch
            floats = np.array([[p.temperature for p in params], [p.top_p if p.temperature else 1.0 for p in params],
                               [p.min_p if p.temperature else 0.0 for p in params]], np.float32)  # [3, batch]
            ints = np.array([[p.top_k if 0 < p.top_k < vocab and p.temperature else vocab for p in params],
                             [s % (1 << 63) for s in seeds], positions], np.int64)  # [3, batch]
            f, i = upload_packed([floats, ints], device)
            drawn = dict(temperature=f[0], top_p=f[1], min_p=f[2], top_k=i[0], seeds=i[1], positions=i[2])
        filtered = any(p.temperature and (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0) for p in params)
        return cls(
            **(drawn or dict.fromkeys(("temperature", "top_k", "top_p", "min_p", "seeds", "positions"))),
            repetition_penalty=col([p.repetition_penalty for p in params]) if seen is not None else None,
            presence_penalty=col([p.presence_penalty for p in params]) if counts is not None else None,
            frequency_penalty=col([p.frequency_penalty for p in params]) if counts is not None else None,
            seen=seen, counts=counts, logit_bias=bias, all_greedy=greedy, filtered=filtered,
            allowed=allowed,
            num_logprobs=max(logprobs) if logprobs else None)


def pack_ids(rows: list[list[int] | None], vocab: int) -> np.ndarray:
    """Each row's ids as a packed mask [rows, ceil(vocab / 32)] int32, id 32 w + b as bit b of word w (every id where
    the row is None)."""
    words = np.full((len(rows), -(-vocab // 32)), -1, dtype=np.int32).view(np.uint32)
    for r, ids in enumerate(rows):
        if ids is not None:
            ids = np.asarray(ids, dtype=np.int64)
            words[r] = 0
            np.bitwise_or.at(words[r], ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))
    return words.view(np.int32)


@dataclass
class Logprobs:
    chosen: torch.Tensor  # [batch] fp32: log-probability of the sampled id (of the model's raw distribution)
    top: torch.Tensor  # [batch, n] fp32, best first
    top_ids: torch.Tensor  # [batch, n] int64


def sample_batch(logits: torch.Tensor, t: SamplingTensors, ops=reference) -> tuple[torch.Tensor, Logprobs | None]:
    """logits [batch, vocab] (any float dtype: the lm_head's output as it is) -> ids [batch] int64, and logprobs when
    some row asked for them. The logit bias first (as vLLM applies it), then the allowed ids (ops.apply_token_bitmask,
    in place), the penalties (repetition, then presence / frequency), then the draw: logits / T, the filters (top-k,
    min-p, top-p: ops.draw_filtered) and a Gumbel-max draw (ops.gumbel_argmax without filters): argmax(logits / T + g),
    g = -log(-log(u)), draws from softmax(logits / T) exactly; a greedy row (T = 0) takes its argmax. With nothing
    else asked the logits are read as they are, in one launch. ops: the backend's (its kernels), or the reference.
    Logprobs are of the raw logits."""
    raw = logits
    if t.logit_bias is not None or t.allowed is not None or t.seen is not None or t.counts is not None:
        logits = logits.float()  # what changes the logits works in fp32
    if t.logit_bias is not None:
        logits = logits + t.logit_bias
    if t.allowed is not None:
        if logits is raw:  # the mask writes in place, and raw gives the logprobs
            logits = logits.clone()
        ops.apply_token_bitmask(logits, t.allowed)
    if t.seen is not None:
        penalty = t.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(t.seen, penalized, logits)
    if t.counts is not None:
        logits = logits - t.counts * t.frequency_penalty[:, None] - (t.counts > 0) * t.presence_penalty[:, None]
    if t.all_greedy:
        ids = ops.argmax(logits)
    elif not t.filtered:
        ids = ops.gumbel_argmax(logits, t.seeds, t.positions, t.temperature)
    else:
        ids = ops.draw_filtered(logits, t.seeds, t.positions, t.temperature, t.top_k, t.top_p, t.min_p)
    if t.num_logprobs is None:
        return ids, None
    lp = raw.float().log_softmax(-1)
    top = lp.topk(t.num_logprobs, dim=-1) if t.num_logprobs else None
    return ids, Logprobs(lp.gather(1, ids[:, None])[:, 0],
                         top.values if top else lp[:, :0], top.indices if top else ids[:, None][:, :0])
