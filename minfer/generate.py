"""CLI: python -m minfer.generate [CHECKPOINT] -p "..." -- streams text to stdout, stats to stderr.

Exit status: 0 done; 1 an error in the input (one line on stderr); 130 interrupted; 141 stdout closed
before the end (e.g. `| head`): generation stops quietly, as for a tool killed by SIGPIPE.
"""
from __future__ import annotations

import argparse
import re
import sys

from .engine_args import add_checkpoint_args, add_engine_args, checkpoint_of
from .errors import ArgumentParser

DTYPES = ("float32", "float16", "bfloat16")
MAX_NEW_TOKENS = 256  # -n's default, but in a conversation


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m minfer.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("-p", "--prompt", action="append",
                   help="prompt text; '-' reads stdin; repeat for a batch (default: 'Hello')")
    p.add_argument("-f", "--file", action="append", dest="prompt", type=PromptFile, metavar="FILE",
                   help="a prompt read from FILE, as llama.cpp's -f (one trailing newline dropped); repeatable, in "
                        "order with -p")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_const", const=True,
                      help="wrap the prompt in the model's chat template (default: raw text, or chat with --system)")
    chat.add_argument("--no-chat", dest="chat", action="store_const", const=False, help="feed the prompt as raw text")
    p.add_argument("-sys", "--system", "--system-prompt", help="system message; implies --chat")
    p.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) in place of the model's; implies --chat")
    p.add_argument("-cnv", "--conversation", action="store_true",
                   help="chat at the terminal, as llama-cli's: messages from stdin, each reply streamed (-p: the first "
                        "message; /exit or Ctrl-D ends, /clear starts over, Ctrl-C stops a reply)")
    p.add_argument("-n", "--max-new-tokens", "--max-tokens", "--n-predict", type=int,
                   help=f"tokens to generate per prompt, at most (default: {MAX_NEW_TOKENS}); a conversation's "
                        "replies: as the context allows, unless given")
    p.add_argument("--ignore-eos", action="store_true",
                   help="end-of-sequence tokens do not stop generation: exactly --max-new-tokens, as the context allows")
    p.add_argument("--temperature", "--temp", type=float, default=0.7,
                   help="0 = greedy, else >= 1e-5 (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="keep the most likely tokens up to this mass, in (0, 1]; 1 = off (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p x the top probability, in [0, 1); 0 = off (default: %(default)s)")
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=1.0,
                   help="> 0; 1 = off (default: %(default)s)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logits of generated ids, in [-2, 2] (default: %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once per occurrence of a generated id, in [-2, 2] (default: %(default)s)")
    p.add_argument("-s", "--seed", type=int,
                   help="sampling seed, per prompt: a prompt samples the same alone or in a batch (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string, not empty (repeatable)")
    p.add_argument("-l", "--logit-bias", action="append", default=[], type=_logit_bias, metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to the token's logit, in [-100, 100], as llama.cpp writes it: 15043+1.5, 2-100 "
                        "(repeatable)")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("-j", "--json-schema", metavar="SCHEMA",
                            help="the output is JSON that follows this JSON schema ('{}': any JSON object)")
    constraint.add_argument("-jf", "--json-schema-file", metavar="FILE", help="the JSON schema, read from FILE")
    constraint.add_argument("--grammar", metavar="GRAMMAR",
                            help="the output follows this grammar (llama.cpp's GBNF, or Lark)")
    constraint.add_argument("--grammar-file", metavar="FILE", help="the grammar, read from FILE")
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--backend", choices=["auto", "cuda", "ref"], default="auto",
                   help="cuda: our kernels; ref: plain torch (default: %(default)s, cuda when built and on a GPU)")
    p.add_argument("-c", "--max-context", "--max-model-len", "--ctx-size", type=int,
                   help="positions per sequence, prompt included (default: the model's)")
    p.add_argument("--dequantize", action="store_true",
                   help="expand a GGUF's quantized matrices to --dtype at load (default: they stay quantized on the "
                        "cuda backend; the ref backend always expands them)")
    add_engine_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also print the load time's parts and peak GPU memory")
    args = p.parse_args(argv)
    args.checkpoint = checkpoint_of(p, args)
    return args


def _logit_bias(spec: str) -> tuple[int, float]:
    """llama.cpp's TOKEN_ID(+/-)BIAS -> (token id, bias)."""
    m = re.fullmatch(r"(\d+)([+-](?:\d+\.?\d*|\.\d+))", spec.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{spec!r} is not TOKEN_ID(+/-)BIAS, e.g. 15043+1.5 or 2-100")
    return int(m[1]), float(m[2])


def _check(args):
    """The options that the engine does not check itself, before anything is loaded."""
    from .errors import MinferError
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise MinferError("--max-new-tokens must be at least 1")
    if "" in args.stop:
        raise MinferError("--stop '' is empty: it would match before the first token")
    for flag, value in (("--system", args.system), ("--chat-template", args.chat_template)):
        if value is not None and args.chat is False:
            raise MinferError(f"{flag} needs the chat template, which --no-chat turns off; drop one of them")
    if args.conversation:
        if args.chat is False:
            raise MinferError("--conversation needs the chat template, which --no-chat turns off; drop one of them")
        if len(args.prompt or []) > 1:
            raise MinferError("--conversation takes one -p or -f (its first message); the rest come from stdin")
        if args.prompt == ["-"]:
            raise MinferError("--conversation reads its messages from stdin, so -p - cannot; give the first with -p TEXT")


def _constraint(args):
    """The StructuredOutputs that -j / -jf / --grammar / --grammar-file give, and that flag; or (None, None)."""
    import json

    from .errors import MinferError, open_input
    from .structured import StructuredOutputs, renamed
    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema), ("--grammar", args.grammar),
                                               ("--json-schema-file", args.json_schema_file),
                                               ("--grammar-file", args.grammar_file)) if value is not None]
    if not given:  # argparse lets at most one through
        return None, None
    (flag, text), = given
    if flag.endswith("-file"):
        try:
            with open_input(text) as f:
                text = f.read()
        except UnicodeDecodeError:
            raise MinferError(f"{flag} {text}: not UTF-8 text") from None
    text = _text(text, flag)
    if "json-schema" in flag:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise MinferError(f"{flag}: not JSON ({e})") from None
        except RecursionError:
            raise MinferError(f"{flag}: nested too deeply") from None
        if not isinstance(schema, (dict, bool)):  # a JSON string here would be read as a schema's text
            raise MinferError(f"{flag}: a JSON schema is an object (or true), not {type(schema).__name__}")
        spec = StructuredOutputs(json_object=True) if schema == {} else StructuredOutputs(json=schema)
    else:
        spec = StructuredOutputs(grammar=text)
    try:
        spec.grammar_text()  # a schema that is no schema, a grammar that does not parse
    except MinferError as e:
        raise renamed(e, flag) from None
    return spec, flag


def _text(arg: str, flag: str) -> str:
    """A command-line string whose bytes were not UTF-8 (Python keeps them as surrogates) with those
    bytes replaced by U+FFFD, and a notice; the tokenizer takes only valid text."""
    fixed = arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if fixed != arg:
        print(f"[minfer] {flag} is not valid UTF-8; its undecodable bytes are replaced by U+FFFD", file=sys.stderr)
    return fixed


# A prompt from stdin or a file, at most: a 10M-token context's text is ~40 MB; `yes | ...` must not fill the memory.
MAX_PROMPT_BYTES = 64 << 20


class PromptFile(str):
    """-f's path, told apart from -p's text in their shared list."""


def _prompt(arg: str) -> str:
    from .errors import MinferError, open_input
    if isinstance(arg, PromptFile):
        where = f"-f {arg}"
        with open_input(arg, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
    elif arg == "-":
        where, data = "stdin", sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
    else:
        return _text(arg, "-p")
    if len(data) > MAX_PROMPT_BYTES:
        raise MinferError(f"{where} holds over {MAX_PROMPT_BYTES >> 20} MiB, more than any context")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        print(f"[minfer] {where} is not valid UTF-8; its undecodable bytes are replaced by U+FFFD", file=sys.stderr)
    return text.removesuffix("\n")  # one trailing newline (from echo or a file) is not part of the prompt


def run(args) -> None:
    from .errors import MinferError
    from .sampling import SamplingParams

    _check(args)
    stop = [_text(s, "--stop") for s in args.stop]
    constraint, constraint_flag = _constraint(args)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed,
                            max_tokens=args.max_new_tokens or MAX_NEW_TOKENS, stop=stop, ignore_eos=args.ignore_eos,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            logit_bias=dict(args.logit_bias), structured_outputs=constraint)
    prompts = [_prompt(p) for p in args.prompt or ([] if args.conversation else ["Hello"])]
    system = None if args.system is None else _text(args.system, "--system")
    if args.chat_template is not None:
        from .tokenizer import load_chat_template
        template = load_chat_template(_text(args.chat_template, "--chat-template"))
    chat_flag = ("--conversation" if args.conversation else "--chat" if args.chat else "--system" if system is not None
                 else "--chat-template" if args.chat_template is not None else None)

    from .engine import format_details, print_stats
    from .llm import LLM
    llm = LLM(args.checkpoint, dtype=args.dtype, device=args.device, backend=args.backend,
              max_model_len=args.max_context, dequantize=args.dequantize, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              long_prefill_token_threshold=args.long_prefill_token_threshold, num_pages=args.num_pages,
              cuda_graph_sizes=args.cuda_graph_sizes,
              block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=args.prefix_caching)
    engine = llm.engine
    fallbacks = engine.ops.fallbacks
    if fallbacks:
        print(f"[minfer] cuda backend: these ops still run on ref: {', '.join(fallbacks)}", file=sys.stderr)
    if args.chat_template is not None:
        engine.tokenizer.chat_template = template
    if constraint is not None:
        from .structured import renamed
        try:
            engine.matchers.check(constraint)
        except MinferError as e:
            raise renamed(e, constraint_flag) from None
    if chat_flag and not engine.tokenizer.chat_template:
        raise MinferError(f"this model has no chat template; drop {chat_flag}")
    if args.conversation:
        from .conversation import converse
        if args.max_new_tokens is None:
            params.max_tokens = engine.max_context  # a reply runs to its end, as the context allows
        engine.check_params(params)  # here, not at the first reply: a bad flag ends the program, not a turn
        converse(llm, params, system, prompts[0] if prompts else None,
                 on_reply=(lambda: print_stats(engine, llm.last_stats)) if args.verbose else None)
        if args.verbose:
            print("\n".join(format_details(engine)), file=sys.stderr)
        return
    # Raw completion by default, so that "-p 'The capital of France is'" continues the text.
    ids = [engine.encode(p, chat_flag is not None, system) for p in prompts]
    single = len(ids) == 1

    def on_text(b, delta):
        if single and delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, lambda b, out: on_text(b, out.new_text),
                           use_tqdm=False)  # the text streams to stdout, the stats follow
    stats = llm.last_stats
    if single:
        sys.stdout.write("\n")
    else:
        for b, out in enumerate(outputs):
            sys.stdout.write(f"--- [{b}] {prompts[b]!r}\n{out.text}\n")
    sys.stdout.flush()
    print_stats(engine, stats, verbose=args.verbose)


def main(argv=None) -> int:
    args = parse_args(argv)
    from .errors import run_cli
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
