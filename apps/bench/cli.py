"""What the apps' command lines share: argparse types whose bad values are usage errors naming their flag (under
minfer.errors.ArgumentParser: one line, exit 1), an early check of --json, and run_cli for a run that returns its
exit status."""
from __future__ import annotations

import argparse
import math
import os

from minfer.errors import MinferError, file_error, run_cli

from .workload import length_range


def int_range(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (hi None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, not {n}")
        return n
    return parse


def seconds(zero_ok: bool = False):
    """An argparse type: a finite number of seconds, > 0 (>= 0 with zero_ok)."""
    def parse(text: str) -> float:
        try:
            s = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(s) or s < 0 or (s == 0 and not zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {bound}, not {text}")
        return s
    return parse


def length_spec(spec: str) -> str:
    """An argparse type: a length spec, N or LO:HI with 1 <= LO <= HI (kept as written, for the report)."""
    if length_range(spec) is None:
        raise argparse.ArgumentTypeError(f"give N or LO:HI with 1 <= LO <= HI, not {spec!r}")
    return spec


def sizes(text: str) -> list[int]:
    """An argparse type: comma-separated sizes, each at least 1."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"give sizes of at least 1, comma-separated, not {text!r}")
    return out


def check_json(path: str | None) -> None:
    """--json opened for appending now, so that a bad path fails before the run rather than after it."""
    if path:
        existed = os.path.exists(path)
        try:
            open(path, "a").close()
        except OSError as e:
            raise MinferError(f"--json {file_error(path, e)}") from None
        if not existed:
            os.remove(path)  # the run writes it


def run_status(fn) -> int:
    """minfer.errors.run_cli for an fn that returns its exit status (1: the run found failures, and said so)."""
    status = []
    return run_cli(lambda: status.append(fn())) or status[0]
