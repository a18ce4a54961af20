"""CLI: python -m minfer.generate [CHECKPOINT] -p "..." -- streams text to stdout, stats to stderr."""
from __future__ import annotations

import argparse
import os
import sys

DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minfer.generate", description=__doc__)
    p.add_argument("checkpoint", nargs="?", help="HF folder, HF hub id or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("-p", "--prompt", action="append", help="prompt text; '-' reads stdin; repeat for a batch")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=False,
                      help="wrap the prompt in the model's chat template (needs one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="feed the prompt as raw text (default)")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--backend", choices=["auto", "cuda", "ref"], default="auto")
    p.add_argument("--max-context", type=int, help="KV cache capacity per sequence (default: the model's)")
    return p.parse_args(argv)


def _check(args):
    from .errors import MinferError
    if args.max_new_tokens < 1:
        raise MinferError("--max-new-tokens must be at least 1")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1 or not 0 <= args.min_p < 1:
        raise MinferError("need --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1, 0 <= --min-p < 1")
    if args.repetition_penalty <= 0:
        raise MinferError("--repetition-penalty must be > 0")
    if args.max_context is not None and args.max_context < 2:
        raise MinferError("--max-context must be at least 2")


def run(args) -> None:
    import torch

    from .engine import Engine, print_stats
    from .sampling import SamplingParams

    _check(args)
    prompts = args.prompt or ["Hello"]
    # One trailing newline (from echo or a file) is not part of the prompt.
    prompts = [sys.stdin.read().removesuffix("\n") if p == "-" else p for p in prompts]
    engine = Engine(args.checkpoint, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device,
                    backend=args.backend, max_context=args.max_context)
    if engine.ops.fallbacks:
        print(f"[minfer] cuda backend: these ops still run on ref: {', '.join(engine.ops.fallbacks)}", file=sys.stderr)
    # Raw completion by default, so that "-p 'The capital of France is'" continues the text.
    ids = [engine.encode(p, args.chat or bool(args.system), args.system) for p in prompts]
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed)

    single = len(ids) == 1

    def on_text(b, delta):
        if single:
            sys.stdout.write(delta)
            sys.stdout.flush()

    outputs, stats = engine.generate(ids, params, args.max_new_tokens, args.stop, on_text)
    if single:
        sys.stdout.write("\n")
    else:
        for b, out in enumerate(outputs):
            sys.stdout.write(f"--- [{b}] {prompts[b]!r}\n{out.text}\n")
    sys.stdout.flush()
    print_stats(engine, stats)


def main(argv=None) -> int:
    args = parse_args(argv)
    from .errors import MinferError
    try:
        run(args)
    except MinferError as e:
        print(f"minfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a one-line report; MINFER_DEBUG=1 shows the traceback
        if os.environ.get("MINFER_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"minfer: error: {type(e).__name__}: {msg} (MINFER_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
