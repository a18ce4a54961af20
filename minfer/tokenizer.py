"""Text <-> ids (the `tokenizers` library) and the chat template (jinja2)."""
from __future__ import annotations

import datetime
import functools
import json
import os
import re

import jinja2
import jinja2.ext
import jinja2.sandbox

from .errors import MinferError, check_readable, file_error, open_input, read_json

# Control tokens that end a turn in common chat formats; they stop generation when present.
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>", "<end_of_turn>")



class Tokenizer:
    def __init__(self, tok, chat_template: str | None, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None  # the template's eos_token
        added = tok.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}
        stops = set(eos_token_ids)
        for t in END_OF_TURN:
            i = tok.token_to_id(t)
            # A user-defined token (added, not special) is text, not a turn's end: Gemma's "</s>" is HTML's
            # strikethrough end tag, which plain text encodes to.
            if i is not None and not (i in added and not added[i].special):
                stops.add(i)
        self.stop_ids = sorted(stops)
        self.byte_level = type(tok.decoder).__name__ == "ByteLevel"

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token spans (added tokens included)."""
        return max(map(len, self.tok.get_vocab(with_added_tokens=True)))

    def check_fits(self, text: str, max_tokens: int | None) -> None:
        """Refuses, before tokenizing it (time and memory grow with the text), a text that takes more than
        max_tokens tokens however it is split: each token spans at most longest_token characters, and 4x that
        for normalizers that merge characters (NFKC joins up to 3 Hangul jamo into one)."""
        if max_tokens is not None and len(text) > 4 * max_tokens * self.longest_token:
            raise MinferError(f"prompt is {len(text)} characters, more than {max_tokens} tokens can hold")

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """max_tokens: refuse a text too long for it before tokenizing (check_fits)."""
        self.check_fits(text, max_tokens)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def special_text(self, token_id: int) -> str | None:
        """A special token's own text (<|im_start|>), which decode skips; None for any other token."""
        return self.tok.id_to_token(token_id) if token_id in self.special_ids else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text, where decode([id]) alone may be U+FFFD (a piece of a multi-byte
        character): byte-level BPE's characters mapped back to bytes, SentencePiece's <0xNN> pieces as one byte,
        other pieces as UTF-8 with '▁' for a space. Special tokens add nothing, as in decode."""
        piece = self.tok.id_to_token(token_id)
        if piece is None or token_id in self.special_ids:
            return b""
        if self.byte_level and all(c in _byte_of_char() for c in piece):
            return bytes(_byte_of_char()[c] for c in piece)
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return bytes([int(m[1], 16)])
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: list[dict], template: str | None = None, *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        """The conversation as text, rendered as transformers renders it. template: one in place of the model's;
        add_generation_prompt: the assistant turn's opening after the messages; continue_final_message: the text
        ends at the last message's content (the template's end of turn cut), so that the model continues it;
        template_kwargs: more of the template's variables (Qwen3's enable_thinking); tools: OpenAI's tool
        definitions, for templates that list them."""
        template = template or self.chat_template
        if not template:
            raise MinferError("this model has no chat template")
        if add_generation_prompt and continue_final_message:
            raise MinferError("continue_final_message and add_generation_prompt cannot both be true")
        if template_kwargs is not None and not (isinstance(template_kwargs, dict)
                                                and all(isinstance(k, str) for k in template_kwargs)):
            raise MinferError("chat_template_kwargs must be a dict of str keys")
        kwargs = dict(template_kwargs or {})
        if reserved := sorted(RENDER_ARGS & kwargs.keys()):
            raise MinferError(f"chat_template_kwargs: {', '.join(reserved)} is set by the request itself")
        tok_text = lambda i: self.tok.id_to_token(i) if i is not None else ""  # noqa: E731
        kwargs = {"bos_token": tok_text(self.bos_token_id), "eos_token": tok_text(self.eos_token_id), **kwargs}
        if continue_final_message:  # transformers' way: a tag after the content marks where the text ends
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise MinferError("continue_final_message: the last message has no text content to continue")
            messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]
        kwargs = {"documents": None, **kwargs}  # as transformers renders: a template may test it against none
        try:
            text = compile_chat_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                          tools=tools, **kwargs)
        except MinferError:  # raise_exception's
            raise
        except Exception as e:  # what the messages or variables did to the template (Jinja's errors, TypeError, ...)
            raise MinferError(f"chat template: {type(e).__name__}: {e}") from None
        if continue_final_message:
            if (at := text.rfind(CONTINUE_TAG.strip())) < 0:
                raise MinferError("continue_final_message: the chat template drops the last message's content")
            # where the template trimmed the tag's trailing space, it trims the content's too
            text = text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()
        return text

    def encode_chat(self, messages: list[dict], max_tokens: int | None = None, template: str | None = None,
                    **render) -> list[int]:
        return self.render_chat(messages, max_tokens, template, **render)[1]

    def render_chat(self, messages: list[dict], max_tokens: int | None = None, template: str | None = None,
                    **render) -> tuple[str, list[int]]:
        """The conversation's text and ids. render: apply_chat_template's options."""
        # The template writes any BOS itself, so none is added here.
        text = self.apply_chat_template(messages, template, **render)
        self.check_fits(text, max_tokens)
        return text, self.tok.encode(text, add_special_tokens=False).ids


RENDER_ARGS = frozenset({"messages", "add_generation_prompt", "tools"})  # what a chat template's caller always sets
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled in transformers' environment (vLLM renders through it): loop controls, a tojson
    that writes non-ASCII and HTML characters as they are, and strftime_now (Llama 3.2 writes today's date)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, _Generation])

    def raise_exception(msg):
        raise MinferError(f"chat template: {msg}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise MinferError(f"chat template: not valid Jinja (line {e.lineno}: {e.message})") from None


class _Generation(jinja2.ext.Extension):
    """transformers' {% generation %} ... {% endgeneration %} (it marks the assistant's tokens for training): the
    body renders as it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def load_chat_template(spec: str, name: str = "--chat-template") -> str:
    """--chat-template (or LLM.chat's chat_template, name), as vLLM reads it: a file's path, or the template itself
    (text with Jinja's braces). Compiled here, so that a broken one is an error before the model loads."""
    if os.path.isfile(spec):
        try:
            with open_input(spec) as f:
                template = f.read()
        except UnicodeDecodeError:
            raise MinferError(f"{name} {spec}: not UTF-8 text") from None
    elif "{{" in spec or "{%" in spec:
        template = spec
    else:
        raise MinferError(f"{name} {spec!r}: no such file (an inline template has Jinja's {{{{ }}}} or {{% %}})")
    try:
        compile_chat_template(template)
    except MinferError as e:
        raise MinferError(f"{name}: {str(e).removeprefix('chat template: ')}") from None
    return template


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's characters back to their bytes."""
    from .gguf import _bytes_to_unicode

    return {c: b for b, c in _bytes_to_unicode().items()}


class StreamDecoder:
    """Turns a growing list of ids into text deltas (the incremental detokenizer of HF's TextStreamer
    and vLLM). Each step decodes a short window ids[prefix:] and returns what it adds to the text of
    ids[prefix:read]: the context tokens keep decoders that strip a leading space (SentencePiece
    Metaspace) from eating it at the window's edge, and bytes of an unfinished UTF-8 character (a
    multi-byte character can span tokens) are held back until the character is complete; flush() gives
    what is held back when the ids end. A complete character goes out at once, as in vLLM: after it, stray
    bytes of the same byte-fallback run (<0xNN> pieces) decode in the next window, where decode of the whole
    ids turns the run into one U+FFFD per byte (tokenizers' ByteFallback) - only invalid output differs."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: context already emitted, decoded again for the seam
        self.read = 0  # ids[read:]: not emitted yet

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text held back at the end (an unfinished character, as decode gives it: U+FFFD a byte)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""  # nothing visible yet, or wait for the rest of the character
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


def from_hf_folder(folder: str, eos_token_ids: list[int], bos_token_id: int | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(folder, "tokenizer.json")
    check_readable(path)
    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # the Rust side raises one exception type for every kind of broken file
        raise MinferError(f"{path}: not a readable tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    cfg = read_json(os.path.join(folder, "tokenizer_config.json"), missing_ok=True) or {}
    template = cfg.get("chat_template")
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if template is None:
        try:
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise file_error(jinja_path, e) from None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

    def token_id(entry):
        text = entry.get("content") if isinstance(entry, dict) else entry
        return tok.token_to_id(text) if text else None

    bos = token_id(cfg.get("bos_token")) if cfg.get("bos_token") else bos_token_id
    eos = list(eos_token_ids)
    if token_id(cfg.get("eos_token")) is not None:
        eos.append(token_id(cfg.get("eos_token")))
    # tokenizer.json's post-processor adds BOS when the model wants one; encode() skips it, so we add it.
    add_bos = bool(cfg.get("add_bos_token", False)) or _post_processor_adds_bos(tok, bos)
    return Tokenizer(tok, template, bos, eos, add_bos)


def _post_processor_adds_bos(tok, bos: int | None) -> bool:
    if bos is None:
        return False
    # Compare with and without special tokens: the probe text itself may encode to the BOS id (e.g. as unk).
    plain, special = tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
    return len(special) > len(plain) and special[0] == bos


def from_gguf(reader) -> Tokenizer:
    from .gguf import _field

    return from_gguf_fields(lambda key, default=None: _field(reader, key, default))


def from_gguf_fields(field) -> Tokenizer:
    """The tokenizer that GGUF fields describe, read by field(key, default=None)."""
    from .gguf import tokenizer_from_fields

    tok, meta = tokenizer_from_fields(field)
    bos, eos = meta["bos_token_id"], meta["eos_token_id"]
    return Tokenizer(tok, meta["chat_template"], bos, [] if eos is None else [eos], meta["add_bos_token"])
