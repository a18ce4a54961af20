"""What one generate() call did and how fast, and the one stats line the CLI prints."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


@dataclass
class Stats:
    """One generate() call. Timed on a warm engine: warm-up (graph capture, first-call costs) is warmup_s."""
    prompt_tokens: int = 0
    tokens: int = 0  # tokens generated over all sequences (a stop token counts: it was computed)
    steps: int = 0  # decode steps: forward passes after the prefill (after every request has its first token)
    decode_tokens: int = 0  # the tokens those steps produced (the prefill gives each sequence its first)
    warmup_s: float = 0.0  # 0 when the engine was already warm for this batch and prompt length
    prefill_s: float = 0.0  # prompts in -> every request's first token on the host
    ttft_s: float = 0.0  # time to first token (the continuous engine: the mean over requests)
    decode_s: float = 0.0  # first tokens on the host -> last tokens on the host
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    preemptions: int = 0  # sequences sent back to the queue (pages freed) for lack of pages

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        """None when there was no decode step (generation ended at the first token)."""
        return self.decode_tokens / self.decode_s if self.steps and self.decode_s else None


def format_stats(engine, stats: Stats) -> str:
    decode = "–" if stats.decode_tok_s is None else f"{stats.decode_tok_s:.1f} tok/s"
    warmup = f" | warmup {stats.warmup_s:.2f} s" if stats.warmup_s else ""
    return (f"[minfer] load {engine.load_s:.2f} s{warmup} | backend {engine.ops.name} "
            f"{str(engine.dtype).replace('torch.', '')} on {engine.device} | prompt {stats.prompt_tokens} tok | "
            f"ttft {stats.ttft_s * 1000:.1f} ms | prefill {stats.prefill_tok_s:.1f} tok/s | decode {decode}"
            + (f" | prefix cache {stats.cached_tokens} tok" if stats.cached_tokens else "")
            + (f" | preempted {stats.preemptions}x" if stats.preemptions else ""))


def format_details(engine) -> list[str]:
    """--verbose: where the load time went, and the peak GPU memory."""
    t = engine.load_times
    other = engine.load_s - t.read - t.upload - t.dequantize
    lines = [f"[minfer] load {engine.load_s:.2f} s: read {t.read:.2f} s, upload {t.upload:.2f} s, "
             f"dequantize {t.dequantize:.2f} s, other {other:.2f} s (parsing, tokenizer, model setup)"]
    if engine.device.type == "cuda":
        lines.append(f"[minfer] peak GPU memory {torch.cuda.max_memory_allocated(engine.device) / 2**30:.2f} GiB")
    return lines


def print_stats(engine, stats: Stats, file=None, verbose: bool = False) -> None:
    """file: default sys.stderr as it is at the call (not at import)."""
    for line in [format_stats(engine, stats)] + (format_details(engine) if verbose else []):
        print(line, file=file or sys.stderr)
