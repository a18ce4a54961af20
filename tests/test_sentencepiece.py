"""SentencePiece GGUF vocabularies against transformers' AutoTokenizer(gguf_file=...): ids, decode and
streaming decode, on small vocabularies written here (Llama, Phi-3 and Gemma 3 layouts) and, when
present, the real Gemma 3 270M file (MINFER_GEMMA3_GGUF or ~/.cache/minfer/gemma-3-270m-q4_k_m.gguf)."""
import collections
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from minfer import tokenizer as mtok
from minfer.sentencepiece import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, from_gguf_fields
from test_tokenizer import BYTE_RUNS, released_early

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SPACE = "\u2581"
CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs there and then
they meet again. Hello world, hello there! This is the thing that the other thing thinks is there.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
    if i % 2 == 0:
        continue
日本語のテキストと日本の文字。中文文本和中文字符。日本語と中文。
"""

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "They think the other thing is there, then the fox runs.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n\tprint(i)",
    "日本語のテキストと中文文本，还有한국어。",
    "I \u2764\ufe0f \U0001f916 and \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f389!",
    "  leading spaces",
    " one leading space",
    "double  spaces  and   triple",
    "\n\nnewlines first\nthen\n\n\nmore\n",
    "\ttabs\tand\t\ttabs\t",
    "trailing   ",
    "a\r\nb \u00a0c",
    " ",
    "   ",
    "x",
    "<s>control</s> in text <|im_end|> and <tool> here",
]


def train_pieces(corpus: str, n_merges: int) -> list[str]:
    """A small SentencePiece-style BPE vocabulary: words carry their leading '▁', merges by pair count."""
    words = collections.Counter(re.findall(f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+", SPACE + corpus.replace(" ", SPACE)))
    seqs = {w: list(w) for w in words}
    pieces = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, n in words.items():
            for a, b in zip(seqs[w], seqs[w][1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w, s in seqs.items():
            i = 0
            while i < len(s) - 1:
                if s[i] == a and s[i + 1] == b:
                    s[i:i + 2] = [a + b]
                i += 1
    return pieces


def llama_vocab():
    """Llama 2's layout: <unk>, <s>, </s>, the 256 byte tokens, merged pieces by rank, then single characters.
    A few corpus characters (and all emoji) are left out, so they fall back to bytes."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0] * 3, [UNKNOWN, CONTROL, CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [BYTE] * 256
    pieces = [p for p in train_pieces(CORPUS, 300) if p not in tokens]
    tokens += pieces
    scores += [-float(i) for i in range(len(pieces))]
    types += [NORMAL] * len(pieces)
    chars = sorted(set(CORPUS.replace(" ", SPACE)) - set("\n\t字符") | {SPACE})
    chars = [c for c in chars if c not in tokens]
    tokens += chars
    scores += [-1000.0 - i for i in range(len(chars))]
    types += [NORMAL] * len(chars)
    tokens += ["<|im_end|>", "<tool>"]
    scores += [0.0, 0.0]
    types += [CONTROL, USER_DEFINED]
    return tokens, scores, types, {"bos": 1, "eos": 2, "unknown": 0}


def gemma_vocab():
    """Gemma 3's layout: <pad> <eos> <bos> <unk> <mask>, newline and space runs (spaces written as real
    spaces), the byte tokens, then pieces. Piece scores are shuffled: Gemma's merge order is file position."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    types = [CONTROL] * len(tokens)
    runs = ["\n" * n for n in range(1, 5)] + [" " * n for n in range(2, 6)] + ["\t" * n for n in range(1, 3)] + ["<tool>"]
    tokens += runs
    types += [USER_DEFINED] * len(runs)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = [p for p in train_pieces(CORPUS, 300) if p not in tokens]
    chars = sorted(set(CORPUS.replace(" ", SPACE)) - set("\n\t字符") | {SPACE})
    tokens += pieces + [c for c in chars if c not in pieces]
    types += [NORMAL] * (len(tokens) - len(types))
    scores = [-1000.0 if ty in (CONTROL, USER_DEFINED) else 0.0 for ty in types]
    n = len(pieces) + len(chars)
    scores[-n:] = [-float(s) for s in np.random.default_rng(0).permutation(n)]
    return tokens, scores, types, {"bos": 2, "eos": 1, "unknown": 3, "padding": 0}


def write_gguf(path, arch, vocab, add_space_prefix):
    """Tokenizer metadata only: AutoTokenizer(gguf_file=...) needs no tensors and no model config."""
    tokens, scores, types, ids = vocab
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for name, i in ids.items():
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", i)
    w.add_add_space_prefix(add_space_prefix)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_both(path):
    reader = gguf.GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    tok, meta = from_gguf_fields(field)
    ours = mtok.Tokenizer(tok, meta["chat_template"], meta["bos_token_id"], [meta["eos_token_id"]], meta["add_bos_token"])
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, ref


@pytest.fixture(scope="module", params=[("llama", llama_vocab, True), ("phi3", llama_vocab, True),
                                        ("gemma3", gemma_vocab, False)], ids=["llama", "phi3", "gemma3"])
def synthetic(request, tmp_path_factory):
    arch, vocab, prefix = request.param
    path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    write_gguf(path, arch, vocab(), prefix)
    return arch, *load_both(path)


def check_text(ours, ref, text, roundtrip=True):
    ids = ours.encode(text)
    assert ids == ref.encode(text), text  # both add BOS
    assert ids[1:] == ref.encode(text, add_special_tokens=False)
    decoded = ours.decode(ids)
    assert decoded == ref.decode(ids, skip_special_tokens=True)
    # the tokens' bytes (<0xNN> pieces one byte each) are the text's, but for the prefix space the decoder strips
    assert b"".join(ours.token_bytes(i) for i in ids).decode() in (decoded, " " + decoded)
    if roundtrip:
        assert decoded == text
    dec = mtok.StreamDecoder(ours)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == decoded


def roundtrips(arch, text):
    """Texts that decode back to themselves: control tokens are skipped on decode, and Llama's Metaspace
    adds the prefix space only when the text has none, so a text's own leading space is lost (as in
    transformers)."""
    return "<s>" not in text and not (arch == "llama" and text.startswith(" "))


def test_same_pipeline_as_transformers(synthetic):
    """Vocabulary, merges (their order included) and added tokens equal transformers', so any text agrees."""
    arch, ours, ref = synthetic
    a, b = json.loads(ours.tok.to_str()), json.loads(ref.backend_tokenizer.to_str())
    assert a["model"]["vocab"] == b["model"]["vocab"]
    assert a["model"]["merges"] == b["model"]["merges"]
    assert a["added_tokens"] == b["added_tokens"]
    assert a["decoder"] == b["decoder"]


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(synthetic, text):
    arch, ours, ref = synthetic
    check_text(ours, ref, text, roundtrips(arch, text))


def random_texts(n):
    """Random mixes of words, spaces, tabs, newlines, CJK, emoji, token markers and a literal '▁'."""
    parts = ["the", "fox", "thing", "return", "日本", "字", "🤖", "é", " ", "  ", "\n",
             "\t", "\r\n", "(", "):", "<s>", "<tool>", "<0x41>", SPACE]
    rng = np.random.default_rng(1)
    return ["".join(rng.choice(parts, size=rng.integers(1, 12))) for _ in range(n)]


def test_random_texts_match_transformers(synthetic):
    arch, ours, ref = synthetic
    for text in random_texts(200):
        check_text(ours, ref, text, roundtrip=False)


def run_ids(tok, pieces):
    """test_tokenizer's BYTE_RUNS pieces as this tokenizer's ids: a word's text encoded (without BOS), a byte's
    piece, <s> as BOS. Generated ids need not be valid UTF-8."""
    ids = []
    for p in pieces:
        ids += [tok.bos_token_id] if p == "<s>" else tok.encode(p.replace("\u2581", " "))[1:] if isinstance(p, str) \
            else [tok.tok.token_to_id(f"<0x{p:02X}>")]
    return ids


def check_ids(ours, ref, ids):
    """decode is transformers' decode, and so is the streamed text with what flush() gives at the end, unless the
    stream released a complete character of an invalid byte run (released_early): then up to that character."""
    expected = ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == expected, ids
    dec = mtok.StreamDecoder(ours)
    deltas = [dec.push(i) for i in ids]
    early = released_early(ours, ids)
    if early is None:
        assert "".join(deltas) + dec.flush() == expected, ids
    else:
        assert "".join(deltas[:early]) == ref.decode(ids[:early], skip_special_tokens=True), ids


@pytest.mark.parametrize("parts", BYTE_RUNS.values(), ids=BYTE_RUNS.keys())
def test_invalid_bytes_match_transformers(synthetic, parts):
    arch, ours, ref = synthetic
    check_ids(ours, ref, run_ids(ours, parts))


def test_random_bytes_match_transformers(synthetic):
    arch, ours, ref = synthetic
    parts = ["\u2581the", "\u2581fox", "\u2581", "x", "<s>", 0x41, 0x80, 0xBF, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F,
             0xA4, 0xFF]
    rng = np.random.default_rng(2)
    for _ in range(100):
        check_ids(ours, ref, run_ids(ours, [parts[k] for k in rng.integers(len(parts), size=rng.integers(1, 12))]))


def test_merges_matter(synthetic):
    """Common words come out whole, and characters outside the vocabulary fall back to their UTF-8 bytes."""
    arch, ours, _ = synthetic
    pieces = [ours.tok.id_to_token(i) for i in ours.encode("the fox jumps over the dog \u5b57\U0001f916")[1:]]
    assert {SPACE + "fox", SPACE + "jumps", SPACE + "over", SPACE + "the"} <= set(pieces)
    assert pieces[-7:] == ["<0xE5>", "<0xAD>", "<0x97>", "<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]


def test_metadata(synthetic):
    arch, ours, ref = synthetic
    assert ours.add_bos and ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    control = "<end_of_turn>" if arch == "gemma3" else "<|im_end|>"
    assert ours.decode(ours.encode(f"a{control}")) == "a"  # control: one token, skipped on decode
    assert ours.decode(ours.encode("a<tool>")) == "a<tool>"  # user-defined: one token, kept


def test_add_space_prefix_false_llama(tmp_path):
    """A Llama-style file that turns the prefix off gets no '▁' before the first word (llama.cpp's rule;
    transformers ignores the flag for these files)."""
    path = tmp_path / "noprefix.gguf"
    write_gguf(path, "llama", llama_vocab(), False)
    ours, _ = load_both(path)
    toks = [ours.tok.id_to_token(i) for i in ours.encode("the fox")[1:]]
    assert not toks[0].startswith(SPACE) and toks[-1] == SPACE + "fox"
    assert ours.decode(ours.encode(" the  fox")) == " the  fox"


def test_a_user_defined_turn_end_name_is_text(tmp_path):
    """A user-defined piece spelled like a turn's end ("</s>", HTML's strikethrough end tag in Gemma's vocabulary)
    is text, as in transformers: it encodes whole and does not stop generation; the control tokens do."""
    tokens, scores, types, ids = gemma_vocab()
    path = tmp_path / "gemma3.gguf"
    write_gguf(path, "gemma3", (tokens + ["</s>"], scores + [-1000.0], types + [USER_DEFINED], ids), False)
    ours, ref = load_both(path)
    end_tag = ours.tok.token_to_id("</s>")
    assert ours.encode("<s>a</s>") == ref.encode("<s>a</s>") and end_tag in ours.encode("<s>a</s>")
    assert end_tag not in ours.stop_ids
    assert {ours.tok.token_to_id("<end_of_turn>"), ours.eos_token_id} <= set(ours.stop_ids)


def test_gemma_template_needs_alternating_turns(synthetic):
    """A Gemma file without a chat template gets Google's: after any system message the turns alternate user,
    model, user, ...; anything else is an error, as Google's template raises it."""
    from minfer.errors import MinferError

    arch, ours, _ = synthetic
    if arch != "gemma3":
        pytest.skip("Gemma's template")
    user, model = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    system = {"role": "system", "content": "s"}
    assert ours.apply_chat_template([system, user, model, user]).count("<start_of_turn>") == 4
    for messages in ([user, user], [model, user], [system, model], [user, model, model]):
        with pytest.raises(MinferError, match="roles must alternate"):
            ours.apply_chat_template(messages)


GEMMA3_GGUF = os.environ.get("MINFER_GEMMA3_GGUF", os.path.expanduser("~/.cache/minfer/gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="module")
def gemma3_real():
    if not os.path.isfile(GEMMA3_GGUF):
        pytest.skip(f"no Gemma 3 GGUF at {GEMMA3_GGUF} (set MINFER_GEMMA3_GGUF)")
    return load_both(Path(GEMMA3_GGUF))


def test_real_gemma3(gemma3_real):
    ours, ref = gemma3_real
    a, b = json.loads(ours.tok.to_str()), json.loads(ref.backend_tokenizer.to_str())
    assert a["model"]["vocab"] == b["model"]["vocab"] and a["model"]["merges"] == b["model"]["merges"]
    assert a["added_tokens"] == b["added_tokens"]
    for text in TEXTS + ["<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
                         "<table><tr><td>1</td></tr></table>", "\n" * 40 + " " * 40 + "\t" * 40]:
        check_text(ours, ref, text, roundtrip="_turn>" not in text)
    for text in random_texts(200):
        check_text(ours, ref, text, roundtrip=False)
    for parts in BYTE_RUNS.values():
        check_ids(ours, ref, run_ids(ours, parts))
    end_tag = ours.tok.token_to_id("</s>")  # user-defined: text, not a turn's end
    assert end_tag in ref.encode("a</s>") and end_tag not in ours.stop_ids
