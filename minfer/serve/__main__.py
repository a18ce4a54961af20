"""python -m minfer.serve [CHECKPOINT] -- an OpenAI-compatible HTTP server (vLLM's flag names).

    python -m minfer.serve --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "Hello", "max_tokens": 8}'
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from .. import shapes
from ..engine_args import add_checkpoint_args, add_engine_args, checkpoint_of, engine_kwargs
from ..errors import ArgumentParser, MinferError, run_cli
from ..generate import DTYPES
from .reasoning import END as REASONING_END, PARSERS as REASONING_PARSERS, START as REASONING_START
from .tool_parser import PARSERS


def json_list(text: str) -> list[str]:
    """vLLM's form of a CORS list: '["http://localhost:3000"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings, e.g. '[\"http://localhost:3000\"]'")
    return value


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m minfer.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--shape", choices=sorted(shapes.SHAPES),
                   help="instead of a checkpoint, random weights of this model's shape and a placeholder "
                        "byte-level tokenizer (minfer.quantize's), for benchmarks")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--api-key", default=os.environ.get("MINFER_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' on /v1 (default: $MINFER_API_KEY, else none)")
    for flag, default, what in [("--allowed-origins", '["*"]', "origins"), ("--allowed-methods", '["*"]', "methods"),
                                ("--allowed-headers", '["*"]', "headers")]:
        p.add_argument(flag, type=json_list, default=default, metavar="JSON",
                       help=f"CORS: the {what} a browser page may use, a JSON list (default: %(default)s)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: pages may send credentials")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the checkpoint's file name)")
    p.add_argument("--max-waiting", type=int,
                   help="requests waiting for admission, at most; more get 429 (default: no limit)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body limit; more gets 413")
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--backend", choices=["auto", "cuda", "ref"], default="auto", help="default: %(default)s")
    p.add_argument("-c", "--max-context", "--max-model-len", "--ctx-size", type=int,
                   help="positions per sequence, prompt included (default: the model's)")
    p.add_argument("--dequantize", action="store_true", help="expand a GGUF's quantized matrices at load")
    p.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) in place of the model's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' (OpenAI's default with tools): the calls the model writes, in the format of "
                        "--tool-call-parser, come back as tool_calls")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), help="the model's tool-call format (hermes: Qwen2.5, "
                                                                       "Qwen3, Hermes)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   help="the model's reasoning between <think> and </think> comes back as reasoning_content, apart from "
                        "the answer, and a structured output holds after </think> where the prompt leaves the reasoning "
                        "open (deepseek_r1: DeepSeek-R1, QwQ; qwen3: Qwen3)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: requests run in arrival order; priority: by each request's priority field, lower "
                        "first, then arrival, and a full KV cache preempts the last in that order (default: %(default)s)")
    add_engine_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    args.checkpoint = checkpoint_of(p, args)
    if args.shape and args.checkpoint:
        p.error("give a CHECKPOINT or --shape, not both")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        p.error("--enable-auto-tool-choice and --tool-call-parser come together")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.max_waiting is not None and args.max_waiting < 0:
        raise MinferError("--max-waiting must be >= 0")
    import uvicorn

    from .. import loader
    from ..engine.core import EngineCore
    from ..tokenizer import load_chat_template
    from .api import build_app
    from .async_engine import AsyncEngine

    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = dict(random_weights=shapes.config(args.shape)) if args.shape else dict(checkpoint=args.checkpoint)
    core = EngineCore(**model, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device,
                      backend=args.backend, max_context=args.max_context, dequantize=args.dequantize,
                      prompt_graphs=True, scheduling_policy=args.scheduling_policy, **engine_kwargs(args))
    if args.shape:  # a byte-level placeholder vocabulary of the shape's size: the server decodes text as for a model
        from ..quantize import placeholder_vocab
        from ..tokenizer import from_gguf_fields
        core.tokenizer = from_gguf_fields(placeholder_vocab(core.cfg.vocab_size).fields().get)
    if template is not None:
        core.tokenizer.chat_template = template
    core.warmup()
    if args.reasoning_parser and not core.set_reasoning_tags(REASONING_START, REASONING_END):
        logging.getLogger("minfer.serve").info("--reasoning-parser: %s or %s is not one token of the vocabulary: a "
                                               "structured output holds from its first token", REASONING_START,
                                               REASONING_END)
    name = args.served_model_name or args.shape or os.path.basename(
        os.path.normpath(args.checkpoint or loader.DEFAULT_MODEL_FILE))
    engine = AsyncEngine(core)
    logging.getLogger("minfer.serve").info(
        "serving %s on http://%s:%d (%s, %s, %d KV pages of %d tokens, context %d)", name, args.host, args.port,
        core.device, core.ops.name, core.block_manager.num_pages, args.block_size, core.max_context)
    app = build_app(engine, name, api_key=args.api_key, max_waiting=args.max_waiting,
                    max_body_bytes=args.max_body_bytes, tool_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser,
                    cors=dict(allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                              allow_methods=args.allowed_methods, allow_headers=args.allowed_headers))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        engine.stop()


if __name__ == "__main__":
    sys.exit(run_cli(main))
