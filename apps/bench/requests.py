"""The random requests of the end-to-end benchmarks (bench_throughput.py, bench_serve.py): the same seed gives
the same requests in both. No torch: bench_serve is a plain HTTP client."""
from __future__ import annotations

import random


def lengths(spec: str, n: int, rng: random.Random) -> list[int]:
    """n lengths from "N" or "LO:HI" (uniform, inclusive)."""
    lo, _, hi = spec.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise SystemExit(f"bad length {spec!r} (N or LO:HI, 1 <= LO <= HI)")
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(num: int, input_len: str, output_len: str, vocab: int, seed: int,
                  shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    """num (prompt ids, max new tokens) pairs of random ids; every prompt starts with the same shared_prefix
    ids (inside its input length)."""
    rng = random.Random(seed)
    ins, outs = lengths(input_len, num, rng), lengths(output_len, num, rng)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    reqs = []
    for n_in, n_out in zip(ins, outs):
        tail = [rng.randrange(vocab) for _ in range(max(0, n_in - len(prefix)))]
        reqs.append(((prefix + tail)[:max(n_in, 1)], n_out))
    return reqs
