"""Tokenizer wrapper and the streaming decoder, on small tokenizers built in the test."""
import json
import os
import random

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from minfer import tokenizer as mtok
from minfer.gguf import _bytes_to_unicode


def byte_tokenizer():
    """Byte-level BPE with no merges: every UTF-8 byte is its own token, so characters span tokens."""
    chars = _bytes_to_unicode()
    tok = HFTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return mtok.Tokenizer(tok, None, None, [], False)


def metaspace_tokenizer():
    """SentencePiece-style words with a leading '▁' whose decoder strips the first space."""
    words = ["▁the", "▁cat", "▁sat", "▁on", "▁a", "▁mat", "s", "."]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="."))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return mtok.Tokenizer(tok, None, None, [], False), len(words)


def stream(tokenizer, ids):
    dec = mtok.StreamDecoder(tokenizer)
    return [dec.push(i) for i in ids]


@pytest.mark.parametrize("text", ["🤖", "héllo 🤖🎉 wörld 中文 👨‍👩‍👧", "a" * 40 + "👍🏽" * 10])
def test_stream_decoder_holds_split_utf8(text):
    tok = byte_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: characters really span tokens
    deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    if any(ord(c) > 127 for c in text):
        assert "" in deltas  # a multi-byte character was held back at least once
    # each delta ends on a character boundary: the prefixes are exactly the text's prefixes
    acc = ""
    for d in deltas:
        acc += d
        assert text.startswith(acc)


@pytest.mark.parametrize("text", ["🤖", "héllo 🤖🎉 wörld 中文 👨‍👩‍👧", "tabs\tand\nnewlines"])
def test_token_bytes_rebuild_the_text(text):
    """Each token's bytes (a byte-level piece of a character alone decodes to U+FFFD) join to the text's UTF-8."""
    tok = byte_tokenizer()
    ids = tok.encode(text)
    assert any(tok.decode([i]) == "\ufffd" for i in ids) or text.isascii()
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_stream_decoder_unfinished_character_is_not_emitted():
    tok = byte_tokenizer()
    ids = tok.encode("ok 🤖")
    assert "".join(stream(tok, ids[:-1])) == "ok "


def test_stream_decoder_keeps_spaces_across_the_window():
    tok, vocab = metaspace_tokenizer()
    rng = random.Random(os.urandom(8))
    ids = [rng.randrange(vocab) for _ in range(60)]
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)


def byte_fallback_tokenizer():
    """SentencePiece-style pieces, the 256 byte pieces <0xNN> and a special <s>, with the decoder chain
    transformers gives Llama's files: '▁' to a space, ByteFallback, Fuse, the prefix space stripped."""
    pieces = ["<unk>", "<s>", "▁the", "▁fox", "▁", "a"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                 byte_fallback=True))
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return mtok.Tokenizer(tok, None, 1, [], False)


def reference_decode(tok, ids):
    """The tokenizers library's decoder chain on the pieces, special tokens left out (decode's skip)."""
    return tok.tok.decoder.decode([tok.tok.id_to_token(i) for i in ids if i not in tok.special_ids])


# Byte pieces (ints) among words: ByteFallback decodes each run of byte pieces as its UTF-8 text, or as one
# U+FFFD per byte when the run is not valid UTF-8 as a whole.
BYTE_RUNS = {
    "lone continuation byte": ["\u2581the", 0x80, "\u2581fox"],
    "lone continuation byte at the end": ["\u2581the", 0x80],
    "two lone continuation bytes": ["\u2581the", 0x80, 0xBF, "a"],
    "character cut short, then a word": ["\u2581the", 0xE2, 0x82, "\u2581fox"],
    "character cut short at the end": ["\u2581the", 0xE2, 0x82],
    "foreign byte inside a character": ["\u2581the", 0xE2, 0x41, 0x82, 0xAC, "\u2581fox"],
    "character, then a stray byte": ["\u2581the", 0xE2, 0x82, 0xAC, 0x80, "\u2581fox"],
    "character, then a stray byte at the end": ["\u2581the", 0xE2, 0x82, 0xAC, 0x80],
    "character, then one cut short": ["\u2581the", 0xE2, 0x82, 0xAC, 0xE2, "\u2581fox"],
    "stray byte, then a character": ["\u2581the", 0x80, 0xE2, 0x82, 0xAC, "\u2581fox"],
    "invalid byte alone": [0xFF],
    "character at the end": ["\u2581the", 0xF0, 0x9F, 0xA4, 0x96],
    "character across a special token": ["\u2581the", 0xE2, "<s>", 0x82, 0xAC, "\u2581fox"],
    "stray byte across a special token": ["\u2581the", 0xE2, 0x82, "<s>", 0xAC, 0x80, "<s>"],
}


def piece_ids(tok, pieces):
    return [tok.tok.token_to_id(p if isinstance(p, str) else f"<0x{p:02X}>") for p in pieces]


def released_early(tok, ids) -> int | None:
    """Where the stream releases a complete character of a byte run that is not valid UTF-8 as a whole (the
    index after its last byte), or None: there decode of all the ids gives the run one U+FFFD per byte."""
    byte_of = {tok.tok.token_to_id(f"<0x{b:02X}>"): b for b in range(256)}
    run, at = b"", []
    for k, i in enumerate([*ids, None]):
        if i in tok.special_ids:
            continue  # decode skips special tokens: a run goes on past them
        if i in byte_of:
            run, at = run + bytes([byte_of[i]]), at + [k + 1]
            continue
        if run and not valid_utf8(run):
            for j in range(1, len(run)):
                if valid_utf8(run[:j]):
                    return at[j - 1]
        run, at = b"", []
    return None


def valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("pieces", BYTE_RUNS.values(), ids=BYTE_RUNS.keys())
def test_stream_decoder_byte_runs_match_the_reference(pieces):
    """decode is the reference decoder's text, and so is the streamed text (with flush() at the end) unless a
    complete character of an invalid run went out before the stray byte came: then that character is released
    the moment it completes (as in vLLM), and the text up to it is decode's of the ids up to it."""
    tok = byte_fallback_tokenizer()
    ids = piece_ids(tok, pieces)
    expected = reference_decode(tok, ids)
    assert tok.decode(ids) == expected
    dec = mtok.StreamDecoder(tok)
    deltas = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert dec.flush() == ""
    early = released_early(tok, ids)
    if early is None:
        assert "".join(deltas) + tail == expected
    else:
        assert "".join(deltas[:early]) == tok.decode(ids[:early]) == reference_decode(tok, ids[:early])


def test_stream_decoder_random_byte_runs_match_the_reference():
    tok = byte_fallback_tokenizer()
    rng = random.Random(0)
    parts = ["\u2581the", "\u2581fox", "\u2581", "a", "<s>", 0x41, 0x80, 0xBF, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0,
             0x9F, 0xA4, 0x96, 0xFF]
    checked = 0
    for _ in range(300):
        ids = piece_ids(tok, [rng.choice(parts) for _ in range(rng.randrange(1, 12))])
        dec = mtok.StreamDecoder(tok)
        streamed = "".join(dec.push(i) for i in ids) + dec.flush()
        assert reference_decode(tok, ids) == tok.decode(ids), ids
        if released_early(tok, ids) is None:
            assert streamed == tok.decode(ids), ids
            checked += 1
    assert checked > 200


def test_hf_folder_bos_detection(tmp_path):
    from tokenizers import processors

    tok = HFTokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    t = mtok.from_hf_folder(str(tmp_path), [2], 0)
    assert t.encode("a b") == [1, 2]  # no post-processor: no BOS
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = mtok.from_hf_folder(str(tmp_path), [2], 0)
    assert t.encode("a b") == [0, 1, 2]
    assert t.stop_ids == [2]
    # the probe text encoding to the BOS id (as unk) is not a BOS-adding post-processor
    tok = HFTokenizer(models.WordLevel({"</s>": 0, "b": 1, "<s>": 2}, unk_token="<s>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "b",
                   "chat_template": "{% for m in messages %}[{{ m.content }}]{{ eos_token }}{% endfor %}"}, f)
    t = mtok.from_hf_folder(str(tmp_path), [], None)
    assert t.encode("c") == [2] and t.encode("b") == [1]
    assert t.stop_ids == [0, 1]  # "</s>" ends a turn in many formats, so it stops too
    # but the template's eos_token is the model's eos, not the smallest stop id
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]b"


def test_a_text_no_context_holds_is_refused_before_tokenizing():
    """encode(text, max_tokens) refuses a text longer than 4 x max_tokens x the longest token's characters (no
    split fits it) without tokenizing it, and never refuses one that could fit."""
    from minfer.errors import MinferError
    tok = byte_tokenizer()
    assert tok.longest_token == 1
    assert len(tok.encode("ab" * 8, max_tokens=4)) == 16  # not over the bound: the engine's own check decides
    with pytest.raises(MinferError, match="17 characters, more than 4 tokens"):
        tok.encode("a" * 17, max_tokens=4)
    tok.check_fits("x" * 17, None)  # no limit given: nothing to check


def test_no_token_spans_more_than_longest_token():
    """The bound's premise on a real BPE vocabulary (the default model's, when installed): a text takes at least
    len(text) / longest_token tokens."""
    from minfer import loader
    path = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        pytest.skip(f"default model not at {path}")
    from minfer import gguf
    tok = mtok.from_gguf(gguf.open_reader(path))
    rng = random.Random(0)
    pieces = ["    ", "=" * 64, "the ", "中文", "🤖", "\n\n", "def f(x):\n    return x\n", "-" * 200, " " * 300]
    for _ in range(20):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        assert len(tok.encode(text)) * tok.longest_token >= len(text)


def test_chat_template_environment_is_transformers():
    """Chat templates render as transformers renders them (and vLLM, through it): {% break %} and {% continue %},
    a tojson that keeps non-ASCII and HTML characters as they are (Qwen2.5 and Llama 3.1 write tool-call
    arguments with it), and strftime_now (Llama 3.2 writes today's date with it)."""
    import datetime

    tok = byte_tokenizer()
    tok.chat_template = ("{%- for m in messages %}{%- if m.role == 'system' %}{%- continue %}{%- endif %}"
                         "[{{ m.content }}]{{ m.tool_calls[0].function.arguments | tojson if m.tool_calls }}"
                         "{%- endfor %}{{ strftime_now('%Y') if strftime_now is defined else 'none' }}")
    args = '{"city": "Zürich", "q": "<b> & \'x\'"}'
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}]
    assert tok.apply_chat_template(messages) == \
        '[u][]"{\\"city\\": \\"Zürich\\", \\"q\\": \\"<b> & \'x\'\\"}"' + str(datetime.date.today().year)


# A Qwen3-like template: the content trimmed, a variable of the caller's (enable_thinking), the generation prompt.
THINKING_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{%- endfor %}"
                     "{%- if add_generation_prompt %}<|im_start|>assistant\n"
                     "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
                     "{%- endif %}")


@pytest.mark.parametrize("template", ["{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                                      "{% if add_generation_prompt %}[assistant] {% endif %}", THINKING_TEMPLATE])
@pytest.mark.parametrize("last", ["Sure, here", "Sure, here ", "  Sure \n"])
@pytest.mark.parametrize("options", [dict(), dict(add_generation_prompt=False),
                                     dict(add_generation_prompt=False, continue_final_message=True),
                                     dict(enable_thinking=False), dict(enable_thinking=True)])
def test_render_options_match_transformers(template, last, options):
    """add_generation_prompt, continue_final_message (the text cut right after the last message's content, its
    trailing spaces as the template kept them) and template variables render as transformers renders them."""
    from transformers import PreTrainedTokenizerFast
    tok = byte_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tok)
    hf.chat_template = template
    messages = [{"role": "user", "content": "Write a list."}, {"role": "assistant", "content": last}]
    render = {k: options[k] for k in ("add_generation_prompt", "continue_final_message") if k in options}
    extra = {k: v for k, v in options.items() if k not in render}
    want = hf.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **render}, **extra)
    assert tok.apply_chat_template(messages, template, **render, template_kwargs=extra) == want


def test_render_option_errors():
    from minfer.errors import MinferError
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    for kwargs, needle in [(dict(continue_final_message=True), "cannot both be true"),
                           (dict(template_kwargs={"messages": []}), "messages is set by the request itself"),
                           (dict(template_kwargs={1: 2}), "dict of str keys"),
                           (dict(add_generation_prompt=False, continue_final_message=True,
                                 template="{% for m in messages %}x{% endfor %}"), "drops the last message's content")]:
        with pytest.raises(MinferError, match=needle):
            tok.apply_chat_template(messages, **{"template": THINKING_TEMPLATE, **kwargs})


def test_tools_render_as_transformers_renders_them():
    """tools as given (None when absent, as documents: a template may test them against none), and transformers'
    {% generation %} tag, whose body renders as it is."""
    from transformers import PreTrainedTokenizerFast
    tok = byte_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tok)
    template = ("{% if tools is not none %}{% for t in tools %}<tool>{{ t | tojson }}</tool>{% endfor %}{% endif %}"
                "{% if documents is not none %}DOCS{% endif %}"
                "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "description": "Zürich <b>", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    for given in (tools, None):
        want = hf.apply_chat_template(messages, tools=given, chat_template=template, tokenize=False)
        assert tok.apply_chat_template(messages, template, tools=given) == want


def test_template_errors_are_minfer_errors():
    """Whatever a template does with the messages or the variables it is given (a TypeError, a division by zero,
    an undefined attribute) is a MinferError naming it; raise_exception's message as it is."""
    from minfer.errors import MinferError
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    for template, kwargs, needle in [("{{ 'Today: ' + date_string }}", {"date_string": 5}, "TypeError"),
                                     ("{{ 1 / 0 }}", {}, "ZeroDivisionError"),
                                     ("{{ messages[3].content.x }}", {}, "UndefinedError"),
                                     ("{{ raise_exception('no system role') }}", {}, "chat template: no system role$")]:
        with pytest.raises(MinferError, match=needle):
            tok.apply_chat_template(messages, template, template_kwargs=kwargs)


def test_load_chat_template(tmp_path):
    from minfer.errors import MinferError
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!")
    assert mtok.load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0].content }}!"
    assert mtok.load_chat_template("{% for m in messages %}{% endfor %}") == "{% for m in messages %}{% endfor %}"
    for spec, needle in [(str(tmp_path / "my{x}.jinja"), "no such file"), ("chatml", "no such file"),
                         ("{{ x", "not valid Jinja")]:
        with pytest.raises(MinferError, match=f"^chat_template.*{needle}"):
            mtok.load_chat_template(spec, "chat_template")
