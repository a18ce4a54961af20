"""The requests of the throughput and serving benchmarks: random token ids of random lengths. The same
arguments draw the same requests, so that apps/bench_throughput.py (the engine alone) and apps/bench_serve.py
(behind the server) compare on the same work."""
from __future__ import annotations

import json
import math
import random

from minfer.errors import MinferError

# --num-requests, at most: the requests are drawn up front, and a typo's billion would fill memory first
MAX_REQUESTS = 1_000_000


def length_range(spec: str) -> tuple[int, int] | None:
    """(LO, HI) of a length spec, a number N or LO:HI with 1 <= LO <= HI; None when spec is not one."""
    lo, sep, hi = spec.partition(":")
    try:
        lo, hi = int(lo), int(hi if sep else lo)
    except ValueError:
        return None
    return (lo, hi) if 1 <= lo <= hi else None


def lengths(spec: str, n: int, rng: random.Random, flag: str) -> list[int]:
    """n lengths from spec: a number N, or LO:HI (uniform, inclusive)."""
    bounds = length_range(spec)
    if bounds is None:
        raise MinferError(f"{flag} {spec!r}: give N or LO:HI, 1 <= LO <= HI")
    return [rng.randint(*bounds) for _ in range(n)]


def make_requests(num_requests: int, input_len: str, output_len: str, vocab: int, seed: int = 0,
                  shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request; each prompt starts with the same shared_prefix ids (within its
    length)."""
    rng = random.Random(seed)
    ins = lengths(input_len, num_requests, rng, "--input-len")
    outs = lengths(output_len, num_requests, rng, "--output-len")
    # only the ids that the longest prompt holds: the rest would be cut off every prompt
    prefix = [rng.randrange(vocab) for _ in range(min(shared_prefix, max(ins, default=0)))]
    reqs = []
    for n_in, n_out in zip(ins, outs):
        tail = [rng.randrange(vocab) for _ in range(max(0, n_in - len(prefix)))]
        reqs.append(((prefix + tail)[:n_in], n_out))
    return reqs


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile of values in seconds (linear interpolation, numpy's default), in ms."""
    if not values:
        return None
    v = sorted(values)
    i = (len(v) - 1) * q / 100
    lo = math.floor(i)
    return 1e3 * (v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (i - lo))


def append_json(path: str | None, row: dict) -> None:
    """Appends row to path as one JSON line (no path: nothing)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
