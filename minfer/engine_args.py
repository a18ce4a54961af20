"""The continuous-batching engine's flags (vLLM's names), shared by `python -m minfer.generate`, `python -m
minfer.serve` and apps/bench_throughput.py, and EngineCore's arguments from them. No torch here: a CLI's --help
stays fast."""
from __future__ import annotations

import argparse

# Page size in tokens: the decode kernel's key tile and vLLM's default (32 and 64 not measured against it yet).
DEFAULT_PAGE_SIZE = 16
# Tokens a step, at most (vLLM's server default on 70+ GB GPUs): a prefill step's host work (~14 ms of launches on
# the default model) is paid once per 8192 tokens. H100, apps/bench_throughput.py: 2048 -> 8192 took the default
# model from 30832 to 36022 output tok/s and the Llama-3-8B shape from 7011 to 7532.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """CHECKPOINT, or -m / --model / -hf (llama.cpp's names); checkpoint_of reads them."""
    p.add_argument("checkpoint", nargs="?",
                   help="HF folder, HF hub id, hub GGUF repo:TYPE (org/Model-GGUF:Q4_K_M), .gguf file or the name of a model "
                        "minfer.fetch installs (gemma3-270m) "
                        "(default: SmolLM2-135M-Instruct Q4_1, from setup.sh)")
    p.add_argument("-m", "--model", "-hf", "--hf-repo", help="the CHECKPOINT, given as an option (-hf: llama.cpp's, for repo:TYPE)")


def checkpoint_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The checkpoint given as CHECKPOINT or as --model (None: the default model; an empty name stays, for the
    loader's error); both at once is an error."""
    if args.model and args.checkpoint:
        p.error("give the checkpoint once: as CHECKPOINT or as --model")
    return args.model if args.checkpoint is None else args.checkpoint


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's and the KV cache's flags, as one group of p's help."""
    g = p.add_argument_group("engine (continuous batching over a paged KV cache)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences in a step, at most (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="tokens in a step, at most: long prompts prefill in chunks (default: %(default)s)")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", metavar="N",
                   help="decode steps' batch sizes captured as CUDA graphs: N (1, 2, 4 and multiples of 8 up to N) "
                        "or a list (default: 1, 2, 4, ..., 256)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="a prompt's chunk in a step with decodes, at most: bounds the running sequences' inter-token "
                        "latency while a long prompt prefills (default: %(default)s, no cap)")
    g.add_argument("--num-pages", type=int,
                   help="KV cache pages (default: from --gpu-memory-utilization on a GPU; up to 1 GiB on the CPU)")
    g.add_argument("--block-size", "--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                   help="tokens a page (default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and KV cache (default: %(default)s)")
    g.add_argument("--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                   help="reuse the KV pages of prompt prefixes seen before (default: on, but for models with "
                        "sliding-window layers, whose keys past the window are freed)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineCore's keyword arguments for add_engine_args' flags."""
    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold, cuda_graph_sizes=args.cuda_graph_sizes,
                num_pages=args.num_pages, page_size=args.block_size,
                gpu_memory_utilization=args.gpu_memory_utilization, prefix_caching=args.prefix_caching)
