"""Logits -> next token ids, entirely on the device (no host sync)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import MinferError

# The smallest temperature above 0: below it logits / temperature overflow fp32 to inf, and the
# probabilities become NaN. Use 0 for greedy.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 0.7  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        # One check per parameter, named by its CLI flag. Each accepts only good values, as NaN fails
        # every comparison (a check that rejects bad values would let NaN through).
        t = self.temperature
        if not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise MinferError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, not {t}")
        if not self.top_k >= 0:
            raise MinferError(f"--top-k must be >= 0 (0 = off), not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise MinferError(f"--top-p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise MinferError(f"--min-p must be in [0, 1), not {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise MinferError(f"--repetition-penalty must be a finite number > 0, not {self.repetition_penalty}")


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
