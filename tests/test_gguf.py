"""GGUF: the default model (SmolLM2-135M-Instruct Q4_1) vs transformers reading the same file, plus unit
tests for the dequantizers and the Q/K un-permute against the `gguf` package and llama.cpp's formula."""
import io
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from minfer import gguf as mgguf
from minfer import loader
from minfer.errors import MinferError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

MODEL_DIR = loader.cache_dir()
MODEL_FILE = loader.DEFAULT_MODEL_FILE
MODEL_PATH = os.path.join(MODEL_DIR, MODEL_FILE)
needs_model = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; 3.14159 and 1,000,000 and 0x1F.",
    "héllo wörld ñ Ünïcödé — «quotes» 中文 日本語 한국어 Ελληνικά русский",
    "emoji: 🤖🎉👍🏽 👨‍👩‍👧 🇫🇷!",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "  leading   spaces\t\ttabs\n\n\n  and   runs      ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll WE'RE they've 'quoted' $$$ ... !!! ???",
    "<|endoftext|>text after end<|im_end|>",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF reader (gguf.quants.dequantize + its own Q/K reverse permute).
    AutoModelForCausalLM.from_pretrained(gguf_file=...) needs `accelerate`, which CI does not have,
    so the model is built from the GGUF config and the state dict that reader returns."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = load_gguf_checkpoint(MODEL_PATH, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval(), state


@pytest.fixture(scope="module")
def engine():
    from minfer.engine import Engine
    return Engine(None, dtype=torch.float32, device="cpu", backend="ref", max_context=256)


@needs_model
@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_hf(text, engine, hf_tokenizer):
    ours = engine.tokenizer.encode(text)
    ref = hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours == ref
    if "<|im_start|>" in text:  # special tokens are single ids
        assert ours[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    # Every text but the special-token ones round-trips through decode.
    if "<|" not in text:
        assert engine.tokenizer.decode(ours) == text


@needs_model
def test_chat_template_matches_hf(engine, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? 🤔"}]
    ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.apply_chat_template(messages) == ref
    assert engine.tokenizer.encode_chat(messages) == hf_tokenizer.encode(ref, add_special_tokens=False)


@needs_model
def test_dequantized_weights_match_hf(engine, hf_model):
    _, state = hf_model
    m, cfg = engine.model, engine.cfg
    assert cfg.tie_word_embeddings and "lm_head.weight" not in state
    cat = lambda *names: torch.cat([state[n] for n in names]).float()  # noqa: E731  the model's fused layout
    pairs = [(m.embed, state["model.embed_tokens.weight"]), (m.final_norm, state["model.norm.weight"])]
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        pairs += [(layer["attn_norm"], state[p + "input_layernorm.weight"]),
                  (layer["mlp_norm"], state[p + "post_attention_layernorm.weight"]),
                  (layer["qkv"], cat(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"))),
                  (layer["o"], state[p + "self_attn.o_proj.weight"]),
                  (layer["gate_up"], cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                  (layer["down"], state[p + "mlp.down_proj.weight"])]
    assert len(pairs) == 2 + 6 * cfg.num_layers and len(state) == 2 + 9 * cfg.num_layers  # every tensor covered
    for ours, ref in pairs:
        # Same blocks dequantized in fp32 by two implementations: equal up to fp32 rounding of d * q + m.
        torch.testing.assert_close(ours, ref.float(), atol=1e-6, rtol=0)


@needs_model
def test_prompt_logprobs_match_hf(hf_model):
    """prompt_logprobs: each prompt token's log-probability given the tokens before it, and the top-n, as
    transformers' log_softmax of the same prompt's logits; the prompt's logits come from several steps (7 tokens a
    step)."""
    from minfer import LLM, SamplingParams

    model, _ = hf_model
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=64, block_size=4, num_pages=64,
              max_num_batched_tokens=7)
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. In 2024, scientists 🤖 found")
    (out,) = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)  # [tokens - 1, vocab]: row j predicts j + 1
    got = out.prompt_logprobs
    assert len(got) == len(ids) > 14 and got[0] is None and [e["token_id"] for e in got[1:]] == ids[1:]
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in got[1:]]),
                               ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-3, rtol=0)
    top = ref.topk(3)
    assert [[i for i, _ in e["top"]] for e in got[1:]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[lp for _, lp in e["top"]] for e in got[1:]]), top.values, atol=1e-3,
                               rtol=0)


@needs_model
def test_teacher_forced_logits_match_hf(engine, hf_model):
    from minfer.kv_cache import KVCache

    model, _ = hf_model
    text = "The quick brown fox jumps over the lazy dog. In 2024, scientists 🤖 discovered that"
    ids = engine.tokenizer.encode(text)
    assert len(ids) >= 20
    cfg = engine.cfg
    cache = KVCache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    ours = engine.model.forward(torch.tensor([ids]), torch.zeros(1, dtype=torch.int32), cache)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    # Both sides run fp32 on bit-identical dequantized weights (test above), so the only difference is
    # fp32 summation order over 30 layers: measured max |diff| ~7e-5 with logits up to ~30. 1e-3 leaves
    # >10x margin; a real bug (RoPE pairing, norm, a wrong scale) moves logits by O(0.1..10).
    assert (ours - ref).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_model
def test_greedy_30_tokens_match_hf_generate(engine, hf_model):
    from minfer.sampling import SamplingParams

    model, _ = hf_model
    ids = engine.tokenizer.encode("The capital of France is")
    outs, _ = engine.generate([ids], SamplingParams(temperature=0.0), max_new_tokens=30)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=30, do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
    stops = set(engine.tokenizer.stop_ids)
    cut = next((i for i, t in enumerate(ref) if t in stops), len(ref))
    assert outs[0].token_ids == ref[:cut]
    assert outs[0].text.startswith(" Paris")


@needs_model
def test_continuous_engine_greedy_matches_hf_generate(hf_model):
    """The continuous engine, the prompt batched with others, prefilled in chunks over pages of 4 tokens."""
    from minfer.engine.core import EngineCore
    from minfer.sampling import SamplingParams

    model, _ = hf_model
    core = EngineCore(None, dtype=torch.float32, device="cpu", backend="ref", max_context=128, page_size=4,
                      num_pages=128, max_num_batched_tokens=6)
    ids = core.tokenizer.encode("The capital of France is")
    others = [core.tokenizer.encode(t) for t in ("Hello world", "def f(x):\n    return")]
    outs, _ = core.generate([ids] + others, [SamplingParams(temperature=0.0, max_tokens=30)] * 3)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=30, do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
    stops = set(core.tokenizer.stop_ids)
    cut = next((i for i, t in enumerate(ref) if t in stops), len(ref))
    assert outs[0].token_ids == ref[:cut]


# ---- dequantizers and the Q/K un-permute ----

def _write_and_read(tmp_path, arrays):
    """Write {name: (float32 array [rows, cols], qtype)} to a GGUF file; return (our reader's tensors, the
    gguf package's) by name."""
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name, (x, qtype) in arrays.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)  # shape from the byte shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.name: t for t in mgguf.open_reader(path).tensors}, {t.name: t for t in gguf.GGUFReader(path).tensors}


QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("kind", QTYPES)
def test_dequantize_matches_gguf_package(kind, tmp_path):
    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng()
    shapes = [(5, 96), (1, 32), (3, 256)]
    arrays = {f"t{i}": ((rng.standard_normal(s) * rng.uniform(0.01, 10)).astype(np.float32) + rng.uniform(-1, 1),
                        qtype) for i, s in enumerate(shapes)}
    tensors, theirs = _write_and_read(tmp_path, arrays)
    for name, (x, _) in arrays.items():
        t, g = tensors[name], theirs[name]
        assert t.kind == g.tensor_type.name == kind
        ours = mgguf.tensor_to_torch(t).float()
        ref = torch.from_numpy(gguf.quants.dequantize(g.data, g.tensor_type).astype(np.float32)).reshape(x.shape)
        assert ours.shape == x.shape
        torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)
        # and close to the original values (quantization error is bounded by the block scale)
        step = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 1 / 15}[kind]
        bound = np.abs(x).reshape(-1, 32).max(1).repeat(32).reshape(x.shape) * step + 1e-6
        if kind == "Q4_1":
            bound = (np.ptp(x.reshape(-1, 32), 1) * step / 2 * 1.01 + np.abs(x).reshape(-1, 32).max(1) * 1e-3).repeat(32).reshape(x.shape)  # + fp16 rounding of m
        assert (np.abs(ours.numpy() - x) <= bound).all()


def _llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 8, 13), (1, 2, 5)])
def test_unpermute_qk_inverts_llamacpp_permute(n_head, head_dim, cols):
    w = torch.randn(n_head * head_dim, cols)
    permuted = _llamacpp_permute(w, n_head)
    if head_dim > 2:
        assert not torch.equal(permuted, w)
    assert torch.equal(mgguf.unpermute_qk(permuted, n_head), w)


def test_unpermute_turns_interleaved_rope_into_rotate_half():
    """Semantics, not just the round trip: RoPE with interleaved pairs on llama.cpp's rows equals
    rotate-half RoPE on the un-permuted rows (up to the same row permutation)."""
    from minfer.ops import reference

    n_head, hd, hidden, tokens = 2, 8, 12, 5
    w_hf = torch.randn(n_head * hd, hidden)
    x = torch.randn(tokens, hidden)
    angles = torch.arange(tokens)[:, None] * (1.0 / 100 ** (torch.arange(0, hd, 2) / hd))[None]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    pos = torch.arange(tokens)
    q_neox = (x @ mgguf.unpermute_qk(_llamacpp_permute(w_hf, n_head), n_head).T).view(tokens, n_head, hd)
    q_inter = (x @ _llamacpp_permute(w_hf, n_head).T).view(tokens, n_head, hd)
    reference.rope(q_neox, q_neox.clone(), pos, cos_sin, True)
    reference.rope(q_inter, q_inter.clone(), pos, cos_sin, False)
    back = mgguf.unpermute_qk(q_inter.reshape(tokens, -1).T, n_head).T.reshape(tokens, n_head, hd)
    torch.testing.assert_close(back, q_neox)


@needs_model
def test_reader_matches_gguf_package():
    """Our header parser against the gguf package's reader on the default model: every metadata field,
    and every tensor's name, type, shape and bytes."""
    ours, ref = mgguf.open_reader(MODEL_PATH), gguf.GGUFReader(MODEL_PATH)
    assert set(ours.fields) == set(ref.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, value in ours.fields.items():
        assert value == ref.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert (t.kind, t.shape, t.n_elements) == (r.tensor_type.name, tuple(int(s) for s in reversed(r.shape)),
                                                   int(r.n_elements))
        assert t.data.numpy().tobytes() == np.asarray(r.data).tobytes(), t.name


@needs_model
def test_load_times_are_recorded():
    times = loader.LoadTimes()
    cfg, weights, _ = loader.load(MODEL_PATH, torch.float32, "cpu", times)
    assert times.read > 0 and times.upload > 0 and times.dequantize > 0
    assert weights["model.embed_tokens.weight"].dtype == torch.float32


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@needs_model
@pytest.mark.parametrize("tty", [True, False])
def test_loading_shows_progress_on_a_terminal_only(tty, monkeypatch):
    """A bar over the file's tensors on stderr where someone watches it (tqdm's disable=None); nothing in logs."""
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    loader.load(MODEL_PATH, torch.float32, "cpu")
    n = len(gguf.GGUFReader(MODEL_PATH).tensors)
    # (the bar is cleared when done, leave=False: what stays is its first state, over the file's n tensors)
    assert ("loading:   0%" in err.getvalue() and f"| 0/{n} [" in err.getvalue()) == tty, err.getvalue()[-300:]
    assert tty or err.getvalue() == ""


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"])
def test_every_format_reads_as_gguf_dequantizes_it(kind, tmp_path, capsys):
    """Random blocks (finite fp16 scales) of the formats with kernels, and of two without (Q2_K, Q3_K: decoded
    by gguf on the host, with a notice)."""
    qtype = gguf.GGMLQuantizationType[kind]
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = 3, 2
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(rows * blocks, size), dtype=np.uint8)
    scale_at = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82],
                "Q3_K": [108]}[kind]
    for at in scale_at:
        raw[:, at:at + 2] = rng.standard_normal((rows * blocks, 1)).astype(np.float16).view(np.uint8)
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("t", raw.reshape(rows, blocks * size), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (t,) = mgguf.open_reader(path).tensors
    assert t.kind == kind and t.shape == (rows, blocks * elems)
    ours = mgguf.tensor_to_torch(t)
    expected = gguf.quants.dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(rows, blocks * elems)
    np.testing.assert_array_equal(ours.numpy(), expected)
    assert (f"GGUF type {kind} has no kernel" in capsys.readouterr().err) == (kind in ("Q2_K", "Q3_K"))


def _one_tensor_file(tmp_path, raw: np.ndarray, qtype) -> str:
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("t", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_file_is_a_one_line_error(tmp_path):
    path = _one_tensor_file(tmp_path, np.zeros((4, 34), dtype=np.uint8), gguf.GGMLQuantizationType.Q8_0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)  # into the tensor data (the file ends in padding)
    with pytest.raises(MinferError, match="past the end of the file"):
        mgguf.open_reader(path)


def test_unknown_tensor_type_is_named(tmp_path):
    path = _one_tensor_file(tmp_path, np.zeros((4, 34), dtype=np.uint8), gguf.GGMLQuantizationType.Q8_0)
    data = bytearray(open(path, "rb").read())
    at = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00t") + 9  # the tensor's name, then its dims and type
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == gguf.GGMLQuantizationType.Q8_0
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(MinferError, match="tensor t: unknown GGUF tensor type 250"):
        mgguf.open_reader(path)


@pytest.mark.parametrize("rows,message", [(6, r"\(F32 \[6, 64\], 1536 bytes\) runs into tensor b at byte"),
                                          (2, r"\(F32 \[2, 64\], 512 bytes\) leaves 512 bytes before tensor b")])
def test_a_tensor_that_does_not_match_its_data_is_named(tmp_path, rows, message):
    """A header whose type and shape give a tensor more bytes than lie before the next tensor's data, or fewer
    than the alignment's padding explains."""
    path = str(tmp_path / "two.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("a", np.zeros((4, 64), dtype=np.float32))
    w.add_tensor("b", np.ones((2, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert [t.name for t in mgguf.open_reader(path).tensors] == ["a", "b"]  # as written, it reads
    data = bytearray(open(path, "rb").read())
    at = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00a") + 9  # after a's name: n_dims, then ne0, ne1
    data[at + 12:at + 20] = rows.to_bytes(8, "little")  # ne1, where 4 rows' 1024 bytes lie
    open(path, "wb").write(bytes(data))
    with pytest.raises(MinferError, match=r"tensor a " + message):
        mgguf.open_reader(path)


def test_rows_that_do_not_fill_blocks_are_named(tmp_path):
    path = _one_tensor_file(tmp_path, np.zeros((4, 34), dtype=np.uint8), gguf.GGMLQuantizationType.Q8_0)
    data = bytearray(open(path, "rb").read())
    at = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00t") + 9
    data[at + 4:at + 12] = (33).to_bytes(8, "little")  # ne0: 33 values a row, not whole blocks of 32
    open(path, "wb").write(bytes(data))
    with pytest.raises(MinferError, match="rows of 33 values do not fill Q8_0 blocks of 32"):
        mgguf.open_reader(path)


# ---- the byte-level pre-tokenizer that tokenizer.ggml.pre names (llama.cpp's table, llama-vocab.cpp) ----
SPELL = mgguf._bytes_to_unicode()
PRE_TEXTS = TEXTS + ["XMLHttpRequest getHTTPResponseCode camelCase", "e\u0301te\u0301 and path/to/x\n/usr", "In 2024"]


def byte_level(pre, tokens=(), merges=("a b",)):
    """The tokenizer of a byte-level BPE file whose tokenizer.ggml.pre is `pre`: the 256 byte characters, "ab", then
    tokens; merges as 'left right'."""
    tokens = [SPELL[b] for b in range(256)] + ["ab", *tokens]
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": list(merges),
              "tokenizer.ggml.pre": pre}
    return mgguf.tokenizer_from_fields(lambda key, default=None: fields.get(key, default))[0]


def words(tok, text):
    return [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


def spelled(pieces):
    return ["".join(SPELL[b] for b in p.encode()) for p in pieces]


# GPT-2's split, as the `regex` package (another engine than the tokenizers library's) runs it
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@pytest.mark.parametrize("pre", sorted(mgguf._PRE_SPLITS))
def test_pre_split_by_regex(pre):
    regex = pytest.importorskip("regex")
    tok = byte_level(pre)
    for text in PRE_TEXTS:
        assert words(tok, text) == spelled(regex.findall(mgguf._PRE_SPLITS[pre], text)), text


@pytest.mark.parametrize("pre", mgguf._DIGITS_THEN_GPT2 + mgguf._GPT2)
def test_gpt2_splits(pre):
    """llama.cpp's GPT-2 type, and its types that split each digit alone first (SmolLM's tokenizer.json: Digits,
    then ByteLevel)."""
    regex = pytest.importorskip("regex")
    tok = byte_level(pre)
    digits = pre in mgguf._DIGITS_THEN_GPT2
    for text in PRE_TEXTS:
        parts = regex.findall(r"\p{N}|\P{N}+", text) if digits else [text]
        assert words(tok, text) == spelled([w for p in parts for w in regex.findall(GPT2_SPLIT, p)]), text


def test_pre_families_split_as_their_models_do():
    """What tells the families apart, worked by hand from each model's pattern: Llama 3 keeps digits in threes,
    Qwen2 and Tekken one by one, SmolLM one by one as words of their own; Tekken and GPT-4o cut words where the
    letter case turns; GPT-2 keeps a space with the next word."""
    split = {pre: words(byte_level(pre), "In 20245 XMLHttpRequest") for pre in
             ("llama-bpe", "qwen2", "tekken", "gpt-4o", "smollm", "gpt-2")}
    g = SPELL[ord(" ")]
    assert split["llama-bpe"] == ["In", g, "202", "45", g + "XMLHttpRequest"]
    assert split["qwen2"] == ["In", g, "2", "0", "2", "4", "5", g + "XMLHttpRequest"]
    assert split["tekken"] == ["In", g, "2", "0", "2", "4", "5", g + "XMLHttp", "Request"]
    assert split["gpt-4o"] == ["In", g, "202", "45", g + "XMLHttp", "Request"]
    assert split["smollm"] == ["In", g, "2", "0", "2", "4", "5", g + "XMLHttpRequest"]
    assert split["gpt-2"] == ["In", g + "20245", g + "XMLHttpRequest"]


def test_llama3_takes_a_word_that_is_a_token_whole():
    """llama.cpp's ignore_merges (Llama 3's and Tekken's tokenizer.json): a word in the vocabulary is its token even
    where the merges would not reach it; Qwen2 merges as usual."""
    for pre, want in (("llama-bpe", ["abc"]), ("tekken", ["abc"]), ("qwen2", ["ab", "c"])):
        tok = byte_level(pre, tokens=["abc"])
        assert [tok.id_to_token(i) for i in tok.encode("abc").ids] == want, pre


def test_unknown_pre_is_refused_and_a_missing_one_is_said(capsys):
    with pytest.raises(MinferError, match="tokenizer.ggml.pre 'deepseek-llm' is not supported; known: .*qwen2"):
        byte_level("deepseek-llm")
    for pre in (None, "default"):
        assert words(byte_level(pre), "In 20245") == ["In", SPELL[ord(" ")] + "20245"]  # GPT-2's split
        assert "words split as GPT-2 splits them" in capsys.readouterr().err


# ---- split models (llama.cpp's NAME-00001-of-0000N.gguf) ----

def _write_split(src: str, out_stem, max_tensors: int) -> list[str]:
    """src rewritten as a split model by gguf's writer (llama-gguf-split's layout: every part a GGUF with split.no
    and split.count, the first with the metadata); the parts' paths."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(out_stem) + ".gguf", reader.fields["general.architecture"].contents(),
                        split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        w.add_key_value(field.name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    paths = [str(p) for p in w.format_shard_names(w.path)]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return paths


@needs_model
def test_a_split_model_loads_from_any_of_its_files(tmp_path):
    """The default model in 3 files: given any of them, the same tensors (bytes, by name) and the same greedy
    tokens as the one file."""
    from minfer.engine.core import EngineCore
    from minfer.sampling import SamplingParams

    paths = _write_split(MODEL_PATH, tmp_path / "m", max_tensors=100)
    assert [os.path.basename(p) for p in paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole = {t.name: t for t in mgguf.open_reader(MODEL_PATH).tensors}
    for p in paths:
        split = mgguf.open_reader(p)
        assert split.fields["general.architecture"] == "llama" and split.fields["split.count"] == 3
        assert [t.name for t in split.tensors] == list(whole)
        assert all(torch.equal(t.data, whole[t.name].data) and t.shape == whole[t.name].shape for t in split.tensors)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ids = [[1, 504, 3575, 282, 4649, 314]]
    runs = [EngineCore(p, dtype=torch.float32, device="cpu", backend="ref", max_context=64, num_pages=16)
            .generate(ids, [params])[0][0].token_ids for p in (MODEL_PATH, paths[1])]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_split_model_errors_name_the_file(tmp_path):
    """A missing part, a part renamed out of the pattern, a part from another split: one-line errors naming it."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama", split_max_tensors=1)
    for name in ("a", "b", "c"):
        w.add_tensor(name, rng.standard_normal((4, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first, second, third = (str(tmp_path / f"s-0000{i}-of-00003.gguf") for i in (1, 2, 3))
    assert [t.name for t in mgguf.open_reader(third).tensors] == ["a", "b", "c"]
    os.rename(second, str(tmp_path / "elsewhere.gguf"))
    with pytest.raises(MinferError, match="s-00002-of-00003.gguf"):
        mgguf.open_reader(first)
    with pytest.raises(MinferError, match="not named NAME-0000N-of-00003.gguf"):
        mgguf.open_reader(str(tmp_path / "elsewhere.gguf"))
    shutil.copy(third, second)  # file 3's content under file 2's name
    with pytest.raises(MinferError, match="s-00002-of-00003.gguf: split.no 2 of 3, where file 2 of 3 has 1 of 3"):
        mgguf.open_reader(first)
