"""Quantizers (quant.quantize_blocks) and the GGUF writer (python -m minfer.quantize).

The legacy formats are checked bit for bit against gguf.quants.quantize; the K-quants by round-trip error
and by gguf's own dequantizer reading what we wrote. Written files are loaded by transformers and by
minfer and compared with each other and with the source model (fp32, CPU, ref backend).
"""
import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from minfer import quant, quantize, shapes
from minfer.config import ModelConfig
from minfer.errors import MinferError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Relative RMSE of dequantize(quantize(x)) on N(0, 1), a little above what each format gives
# (measured: Q8_0 0.0053, Q4_0 0.086, Q4_1 0.078, Q5_0 0.043, Q5_1 0.038, Q4_K 0.071, Q5_K 0.036, Q6_K 0.0177).
ROUND_TRIP = {"Q8_0": 0.006, "Q4_0": 0.095, "Q4_1": 0.085, "Q5_0": 0.047, "Q5_1": 0.042, "Q4_K": 0.08,
              "Q5_K": 0.04, "Q6_K": 0.02}
VOCAB = 320
TEXT = "The quick brown fox jumps over the lazy dog. Hello world! 12345 numbers and words, the end. " * 3
TINY = dict(arch="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256)


def hard_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian rows with the blocks quantizers get wrong first: all zero, constant, tiny, one outlier,
    ties between +max and -max, all negative."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :32] = 0
    x[1, :64] = 1.5
    x[2, :32] *= 1e-6
    x[3, 5] = 40.0
    x[4, :32] = np.where(np.arange(32) % 2, 2.0, -2.0)
    x[5, :256] = -np.abs(x[5, :256]) - 0.5
    return x


@pytest.mark.parametrize("kind", LEGACY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_legacy_quantizers_match_gguf_bit_for_bit(kind, dtype):
    x = hard_rows(48, 512, seed=len(kind))
    x = torch.from_numpy(x).to(dtype)
    expected = gguf.quants.quantize(x.float().numpy(), getattr(gguf.GGMLQuantizationType, kind))
    ours = quant.quantize(kind, x)
    assert ours.dtype == torch.uint8 and ours.shape == expected.shape
    np.testing.assert_array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_round_trip_error_and_format(kind):
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(7))
    blocks = quant.quantize(kind, x)
    assert blocks.shape == (64, 1024 // quant.BLOCK_ELEMS[kind] * quant.BLOCK_BYTES[kind])
    ours = quant.dequantize(kind, blocks.reshape(-1), x.numel()).view_as(x)
    rel = ((ours - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item()
    assert rel < ROUND_TRIP[kind], f"{kind}: relative RMSE {rel:.4f}"
    # The bytes mean the same to gguf's independent dequantizer: the layout is exact, not just close.
    theirs = gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType, kind)).reshape(x.shape)
    np.testing.assert_array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_hard_blocks_stay_finite_and_zero_stays_zero(kind):
    x = torch.from_numpy(hard_rows(8, 512, seed=3))
    y = quant.dequantize(kind, quant.quantize(kind, x).reshape(-1), x.numel()).view_as(x)
    assert torch.isfinite(y).all()
    assert (y[0, :32] == 0).all()
    bound = {"Q8_0": 0.01, "Q6_K": 0.04}.get(kind, 0.2)  # the outlier row: relative error of the row
    assert ((y[3] - x[3]).norm() / x[3].norm()).item() < bound
    zero = quant.quantize(kind, torch.zeros(2, 256))
    assert (quant.dequantize(kind, zero.reshape(-1), 512) == 0).all()


def test_quantize_rejects_bad_rows():
    with pytest.raises(MinferError, match="multiple of 256"):
        quant.quantize("Q4_K", torch.zeros(2, 64))
    with pytest.raises(MinferError, match="no quantizer"):
        quant.quantize("Q3_K", torch.zeros(2, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_quantizers_on_cuda(kind):
    x = torch.from_numpy(hard_rows(64, 1024, seed=11))
    cpu, gpu = quant.quantize(kind, x), quant.quantize(kind, x.cuda()).cpu()
    if kind in LEGACY:
        torch.testing.assert_close(gpu, cpu, rtol=0, atol=0)
    # K-quants: the scale search sums in another order on the GPU, so near-ties may pick another scale;
    # the reconstruction must be as good.
    n = x.numel()
    err = lambda q: (quant.dequantize(kind, q.reshape(-1), n).reshape(x.shape) - x).pow(2).mean().sqrt()  # noqa: E731
    assert err(gpu) <= 1.01 * err(cpu)


def test_permute_is_the_inverse_of_unpermute():
    from minfer.gguf import unpermute_qk

    w = torch.randn(4 * 16, 24)
    for heads in (1, 2, 4):
        torch.testing.assert_close(unpermute_qk(quantize.permute_qk(w, heads), heads), w, rtol=0, atol=0)
        assert not torch.equal(quantize.permute_qk(w, heads), w)


@pytest.mark.parametrize("ftype, base", [("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K")])
def test_tensor_types_of_llama3_8b_match_llama_cpp(ftype, base):
    """llama.cpp's Meta-Llama-3-8B Q4_K_M / Q5_K_M: 65 f32, 193 of the base type, 33 q6_K tensors."""
    cfg = shapes.config("llama-3-8b")
    sizes = {quantize.gguf_name(k): s for k, s in shapes.weight_shapes(cfg).items()}
    types = {k: quantize.tensor_type(k, s, ftype, cfg, True) for k, s in sizes.items()}
    if ftype == "Q5_K_M":
        assert types == {k: llama_cpp_q5_k_m(k, s, 32, tied=False) for k, s in sizes.items()}
    counts = {t: list(types.values()).count(t) for t in set(types.values())}
    assert counts == {"F32": 65, base: 193, "Q6_K": 33}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == base
    more = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # use_more_bits for 32 layers
    assert [i for i in range(32) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == more
    assert [i for i in range(32) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == more
    for i in range(32):
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{part}.weight"] == base


def test_tensor_type_fallbacks_and_other_types():
    cfg = shapes.config("llama-3-8b")
    t = lambda name, cols, ftype, has_output=True, pure=False: quantize.tensor_type(  # noqa: E731
        name, (512, cols), ftype, cfg, has_output, pure)
    assert t("blk.1.ffn_gate.weight", 64, "Q4_K_M") == "Q5_0"  # rows not a multiple of 256
    assert t("blk.1.ffn_gate.weight", 64, "Q5_K_M") == "Q5_1"
    assert t("blk.1.ffn_gate.weight", 64, "Q6_K") == "Q8_0"
    assert t("blk.1.ffn_gate.weight", 100, "Q4_K_M") == "F16"  # not even a multiple of 32
    assert t("output.weight", 64, "Q4_K_M") == "Q8_0"
    assert t("output.weight", 4096, "Q4_0") == "Q6_K" and t("output.weight", 4096, "Q8_0") == "Q8_0"
    assert t("token_embd.weight", 4096, "Q4_K_M", has_output=False) == "Q6_K"  # tied: it is the output
    assert t("token_embd.weight", 4096, "Q4_0") == "Q4_0"
    assert t("blk.0.attn_v.weight", 4096, "Q5_K_M") == "Q6_K" and t("blk.4.attn_v.weight", 4096, "Q5_K_M") == "Q5_K"
    assert t("blk.0.attn_v.weight", 4096, "Q4_K_M", pure=True) == "Q4_K"
    assert t("output.weight", 4096, "Q4_K_M", pure=True) == "Q4_K"
    assert quantize.tensor_type("output_norm.weight", (4096,), "Q4_K_M", cfg, True) == "F32"
    seventy = ModelConfig("llama", 128256, 8192, 28672, 80, 64, 8, 128)
    assert quantize.tensor_type("blk.10.attn_v.weight", (1024, 8192), "Q4_K_M", seventy, True) == "Q5_K"


def llama_cpp_q5_k_m(name: str, shape: tuple, n_layers: int, tied: bool) -> str:
    """llama.cpp's llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q5_K_M (no imatrix, llama arch, no experts),
    written out here independently of minfer.quantize: 1-D tensors stay F32; output.weight (token_embd.weight
    when tied) Q6_K, Q8_0 when its rows are not a multiple of Q5_K's 256; attn_v and ffn_down Q6_K on
    use_more_bits layers, else Q5_K; every other 2-D weight (token_embd included) Q5_K; then
    tensor_type_fallback for a row length not a multiple of the type's block: Q5_K -> Q5_1, Q6_K -> Q8_0,
    F16 when not a multiple of 32 either. (The 70B attn_v rule only lifts Q3_K / Q4_K: no effect here.)"""
    if len(shape) < 2:
        return "F32"
    cols = shape[1]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        t = "Q8_0" if cols % 256 else "Q6_K"
    elif name.endswith((".attn_v.weight", ".ffn_down.weight")):
        i, n = int(name.split(".")[1]), n_layers
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2  # use_more_bits, C integer division
        t = "Q6_K" if more else "Q5_K"
    else:
        t = "Q5_K"
    if cols % (256 if t.endswith("_K") else 32):
        t = {"Q5_K": "Q5_1", "Q6_K": "Q8_0"}[t]
        if cols % 32:
            t = "F16"
    return t


@pytest.mark.parametrize("shape, layers", [("llama-3-8b", n) for n in (1, 2, 3, 7, 9, 16, 22, 40, 80)]
                         + [("llama-3.2-1b", None), ("qwen3-0.6b", None), ("smollm2-135m", None)])
def test_q5_k_m_mix_follows_llama_cpp_rule(shape, layers):
    """Every tensor of several shapes and layer counts (n/8 rounding, 80 layers with GQA as a 70B); tied
    embeddings (the output rule on token_embd); SmolLM2's 576-wide rows (Q5_1 / Q8_0 fallbacks)."""
    cfg = shapes.config(shape)
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    sizes = shapes.weight_shapes(cfg)
    tied = "lm_head.weight" not in sizes
    assert tied == cfg.tie_word_embeddings
    got = {quantize.gguf_name(k): quantize.tensor_type(quantize.gguf_name(k), s, "Q5_K_M", cfg, not tied)
           for k, s in sizes.items()}
    expected = {quantize.gguf_name(k): llama_cpp_q5_k_m(quantize.gguf_name(k), s, cfg.num_layers, tied)
                for k, s in sizes.items()}
    assert got == expected
    if shape == "smollm2-135m":  # 30 layers; hidden 576 = 2.25 * 256, intermediate 1536 = 6 * 256
        assert got["token_embd.weight"] == "Q8_0" and got["blk.4.attn_q.weight"] == "Q5_1"
        assert {got[f"blk.{i}.attn_v.weight"] for i in range(30)} == {"Q5_1", "Q8_0"}
        assert {got[f"blk.{i}.ffn_down.weight"] for i in range(30)} == {"Q5_K", "Q6_K"}


def test_q5_k_m_file_has_llama_cpp_mix(tmp_path, monkeypatch):
    """The types in a written 9-layer Q5_K_M file (not those of tensor_type's plan): 9 // 8 = 1 and 7 * 9 // 8 = 7,
    so attn_v / ffn_down take Q6_K on layers 0, 3, 6, 7, 8; ffn_down's 288-wide rows fall back to Q5_1 / Q8_0."""
    monkeypatch.setitem(shapes.SHAPES, "nine-llama", dict(TINY, hidden_size=256, intermediate_size=288, num_layers=9,
                                                          num_heads=4, num_kv_heads=2, head_dim=64))
    out = tmp_path / "nine.gguf"
    quantize_cli(["--shape", "nine-llama", out, "--type", "Q5_K_M"])
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    cfg = shapes.config("nine-llama")
    sizes = {quantize.gguf_name(k): s for k, s in shapes.weight_shapes(cfg).items()}
    assert types == {k: llama_cpp_q5_k_m(k, s, 9, tied=False) for k, s in sizes.items()}
    assert [i for i in range(9) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 3, 6, 7, 8]
    assert [i for i in range(9) if types[f"blk.{i}.ffn_down.weight"] == "Q8_0"] == [0, 3, 6, 7, 8]
    assert {types[f"blk.{i}.ffn_down.weight"] for i in (1, 2, 4, 5)} == {"Q5_1"}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q5_K"
    assert reader.fields["general.file_type"].contents() == 17  # LLAMA_FTYPE_MOSTLY_Q5_K_M


# ------------------------------------------------------------------------------ whole files

def write_bpe_tokenizer(folder):
    """A byte-level BPE with Llama 3's split, trained on TEXT: 256 bytes, 2 special tokens, merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from minfer.gguf import _LLAMA3_SPLIT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
                   "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)


def build_llama(folder, hidden=64, inter=128, tie=False, seed=0, heads=4):
    """A random tiny Llama (norms perturbed away from 1; heads / 2 kv heads) with a byte-level BPE tokenizer; 320 ids
    for a 300-token tokenizer, so the file pads the vocabulary as llama.cpp's converter does."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   max_position_embeddings=256,
                                   rms_norm_eps=1e-5, initializer_range=0.08, tie_word_embeddings=tie,
                                   bos_token_id=0, eos_token_id=1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    write_bpe_tokenizer(folder)
    return model


def fake_quantized(model, types: dict):
    """A copy of the HF model with each weight replaced by dequantize(quantize(w)) of its planned type."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            t = types.get(quantize.gguf_name(name), "F32")
            if t in quant.BLOCK_ELEMS:
                p.copy_(quant.dequantize(t, quant.quantize(t, p).reshape(-1), p.numel()).view_as(p))
            elif t == "F16":
                p.copy_(p.half().float())
    return out


def minfer_logits(path, ids, dequantize=False):
    """Logits of the file on the ref backend; its matrices stay quantized unless `dequantize`."""
    from minfer import loader
    from minfer.kv_cache import KVCache
    from minfer.model import Transformer
    from minfer.ops import get_backend

    cfg, weights, tok = loader.load(str(path), torch.float32, "cpu", dequantize=dequantize)
    model = Transformer(cfg, weights, get_backend("ref", "cpu"), 64)
    cache = KVCache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    return model.forward(ids, torch.zeros(1, dtype=torch.int32), cache)[0], tok


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0]


def rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def quantize_cli(args):
    assert quantize.main([str(a) for a in args]) == 0


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_0"])
def test_hf_llama_to_gguf_loads_in_transformers_and_minfer(ftype, tmp_path):
    pytest.importorskip("accelerate")  # transformers loads GGUF files through it
    src = tmp_path / "hf"
    hf = build_llama(src)
    out = tmp_path / f"model.{ftype}.gguf"
    quantize_cli([src, out, "--type", ftype])
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))

    tf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    theirs = hf_logits(tf, ids)
    ours, tok = minfer_logits(out, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)  # the same file read two ways
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert set(types.values()) == {"F32", ftype} | ({"Q8_0"} if ftype == "Q4_0" else set())  # output: 64 % 256
    # Exactly the source model with each weight through dequantize(quantize(w)): the permutation and
    # the layout are right; and within the quantization error of the source itself.
    torch.testing.assert_close(theirs, hf_logits(fake_quantized(hf, types), ids), atol=1e-4, rtol=0)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1
    assert rel_rms(theirs, ref) < {"Q8_0": 0.05, "Q4_0": 0.5}[ftype]

    # The tokenizer: the same ids as the source's tokenizer.json, in minfer and in transformers.
    source_tok = transformers.AutoTokenizer.from_pretrained(src)
    text = "The lazy fox says hello world 123"
    expected = source_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text) == [0] + expected  # add_bos_token: BOS first
    tf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert tf_tok(text, add_special_tokens=False)["input_ids"] == expected
    assert tok.decode(tok.encode(text)) == text
    f = lambda k: reader.fields[k].contents()  # noqa: E731
    assert (f("general.architecture"), f("tokenizer.ggml.pre"), f("general.file_type")) == \
        ("llama", "llama-bpe", quantize.FTYPES[ftype][1])
    assert len(f("tokenizer.ggml.tokens")) == VOCAB and f("tokenizer.ggml.token_type")[300:] == [5] * 20
    assert f("tokenizer.ggml.token_type")[:2] == [3, 3] and f("tokenizer.ggml.eos_token_id") == 1


def build_qwen(folder, arch, hidden=64, inter=128, seed=0):
    """A random tiny Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms, head_dim 128 whatever the width) with
    build_llama's tokenizer."""
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.08,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=128))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(folder)
    write_bpe_tokenizer(folder)
    return model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_loads_in_transformers_and_minfer(arch, tmp_path):
    """Qwen files keep HF's Q/K row order (llama.cpp permutes llama's only), Qwen2's biases and Qwen3's q/k norms:
    minfer reads the file as transformers does, and both are the source through dequantize(quantize(w))."""
    pytest.importorskip("accelerate")  # transformers loads GGUF files through it
    src = tmp_path / "hf"
    hf = build_qwen(src, arch)
    out = tmp_path / f"{arch}.Q8_0.gguf"
    quantize_cli([src, out, "--type", "Q8_0"])
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == arch
    assert ("blk.0.attn_q.bias" in {t.name for t in reader.tensors}) == (arch == "qwen2")
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    tf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    theirs = hf_logits(tf, ids)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    torch.testing.assert_close(theirs, hf_logits(fake_quantized(hf, types), ids), atol=1e-4, rtol=0)
    ours, _ = minfer_logits(out, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K"])
def test_k_quant_file_loads_in_transformers(ftype, tmp_path):
    pytest.importorskip("accelerate")  # transformers loads GGUF files through it
    src = tmp_path / "hf"
    hf = build_llama(src, hidden=256, inter=512, tie=True)
    out = tmp_path / f"model.{ftype}.gguf"
    quantize_cli([src, out, "--type", ftype])
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    base = quantize.FTYPES[ftype][0]
    assert "output.weight" not in types and types["token_embd.weight"] == "Q6_K"  # tied: the output rule
    assert types["blk.0.ffn_gate.weight"] == base and types["blk.1.attn_v.weight"] == "Q6_K"
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    tf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    theirs = hf_logits(tf, ids)
    torch.testing.assert_close(theirs, hf_logits(fake_quantized(hf, types), ids), atol=1e-4, rtol=0)
    assert rel_rms(theirs, hf_logits(hf, ids)) < 0.5
    ours, _ = minfer_logits(out, ids)  # v in Q6_K beside q, k in the base type: the split qkv path
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(minfer_logits(out, ids, dequantize=True)[0], ours, atol=1e-5, rtol=0)


def test_shape_source_with_placeholder_tokenizer(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")  # transformers loads GGUF files through it
    monkeypatch.setitem(shapes.SHAPES, "tiny-llama", TINY)
    out = tmp_path / "tiny.gguf"
    quantize_cli(["--shape", "tiny-llama", out, "--type", "Q8_0"])
    ids = torch.tensor([[256, 5, 280, 299, 17]])
    ours, tok = minfer_logits(out, ids)
    tf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    torch.testing.assert_close(ours, hf_logits(tf, ids), atol=1e-4, rtol=0)
    text = "Hello world, ünïcode!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a cat")[0] == 256 and len(tok.encode("a cat")) < 1 + len("a cat")  # BOS; merges apply
    assert tok.stop_ids == [257]
    tf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert tf_tok(text)["input_ids"] == tok.encode(text)


def test_shape_source_is_the_named_shape():
    src = quantize.shape_source("llama-3-8b", "cpu")
    assert src.shapes["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    assert len(src.vocab.tokens) == 128256 and src.vocab.tokens[-1] == "[PAD128255]"
    w = src.read("model.layers.0.input_layernorm.weight")
    assert w.shape == (4096,) and abs(w.mean().item() - 1) < 0.01
    torch.testing.assert_close(w, src.read("model.layers.0.input_layernorm.weight"), rtol=0, atol=0)  # seeded


def float_gguf_array(x: torch.Tensor, kind: str) -> tuple[np.ndarray, dict]:
    """x as a GGUFWriter.add_tensor argument of GGUF type `kind`: BF16 (numpy has none) as its bit patterns."""
    if kind == "BF16":
        return x.bfloat16().view(torch.int16).numpy().view(np.uint16), {"raw_dtype": gguf.GGMLQuantizationType.BF16}
    return x.to(getattr(torch, {"F16": "float16", "F32": "float32"}[kind])).numpy(), {}


# max |logit difference| between the two Q8_0 files: the source's rounding, then Q8_0 again (none from F32)
GGUF_SOURCE_ATOL = {"F32": 0.0, "F16": 0.02, "BF16": 0.1}  # measured: F16 0.011, BF16 0.047


@pytest.mark.parametrize("kind, arch", [("F16", "llama"), ("BF16", "llama"), ("F32", "llama"), ("F32", "qwen3")])
def test_float_gguf_source(kind, arch, tmp_path):
    """An F16 / BF16 / F32 GGUF (written here from the HF model, a llama's Q/K in llama.cpp's order) quantizes like
    the HF folder; from F32 (the HF model's own dtype) to the same bytes."""
    src = tmp_path / "hf"
    build_llama(src) if arch == "llama" else build_qwen(src, arch)
    q8 = tmp_path / "from_hf.gguf"
    quantize_cli([src, q8, "--type", "Q8_0"])
    # The same metadata and tensor names, each tensor the `kind` of the source (norms F32), as convert_hf_to_gguf.
    reader = gguf.GGUFReader(str(q8))
    hf_src = quantize.hf_source(str(src))
    assert {hf_src.read(k).dtype for k in hf_src.shapes} == {torch.float32}
    source = tmp_path / f"{kind}.gguf"
    w = gguf.GGUFWriter(str(source), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        hf_name = next(k for k in hf_src.shapes if quantize.gguf_name(k) == t.name)
        x = hf_src.read(hf_name).float()
        if arch == "llama" and ("attn_q." in t.name or "attn_k." in t.name):
            x = quantize.permute_qk(x, 4 if "attn_q." in t.name else 2)
        data, raw = float_gguf_array(x, "F32" if x.dim() == 1 else kind)
        w.add_tensor(t.name, data, **raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    written = {t.name: (t.tensor_type.name, len(t.shape)) for t in gguf.GGUFReader(str(source)).tensors}
    assert {k for k, d in written.values() if d == 2} == {kind}
    assert {k for k, d in written.values() if d == 1} == {"F32"}
    again = tmp_path / f"from_{kind}.gguf"
    quantize_cli([source, again, "--type", "Q8_0"])
    tensors = {t.name: t for t in gguf.GGUFReader(str(again)).tensors}
    assert {n: t.tensor_type.name for n, t in tensors.items()} == {t.name: t.tensor_type.name for t in reader.tensors}
    if kind == "F32":  # nothing rounded on the way: the very file of the HF folder, tensor for tensor
        for t in reader.tensors:
            np.testing.assert_array_equal(np.asarray(tensors[t.name].data), np.asarray(t.data))
    ids = torch.tensor([[3, 50, 7, 299, 100]])
    a, _ = minfer_logits(q8, ids)
    b, _ = minfer_logits(again, ids)
    torch.testing.assert_close(b, a, atol=GGUF_SOURCE_ATOL[kind], rtol=0)  # the source's rounding, then Q8_0 again


def test_errors_are_one_line(tmp_path, capsys):
    src = tmp_path / "hf"
    build_llama(src)
    out = tmp_path / "x.gguf"
    capsys.readouterr()

    def error(args):
        assert quantize.main([str(a) for a in args]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("minfer: error: ")
        return err

    assert "unknown --type 'Q3_K_S'" in error([src, out, "--type", "Q3_K_S"])
    assert "no such file or folder" in error([tmp_path / "missing", out, "--type", "Q8_0"])
    assert "either SRC or --shape" in error([src, out, "--type", "Q8_0", "--shape", "llama-3-8b"])
    assert "unknown shape" in error(["--shape", "llama-9", out, "--type", "Q8_0"])
    out.write_bytes(b"keep")
    assert "exists; pass --force" in error([src, out, "--type", "Q8_0"])
    assert out.read_bytes() == b"keep"
    quantize_cli([src, out, "--type", "Q8_0", "--force"])
    assert out.read_bytes()[:4] == b"GGUF" and not os.path.exists(str(out) + ".part")
    capsys.readouterr()

    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    assert "unsupported architecture" in error([src, tmp_path / "y.gguf", "--type", "Q8_0"])
    (src / "config.json").write_text(json.dumps(cfg))
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(src / "tokenizer.json"))
    assert "supported: byte-level BPE" in error([src, tmp_path / "y.gguf", "--type", "Q8_0"])
    assert not os.path.exists(tmp_path / "y.gguf")


@pytest.mark.gpu
@pytest.mark.parametrize("ftype, hidden, inter, heads, kind",
                         [("Q4_K_M", 1024, 1536, 4, "Q4_K"), ("Q5_K_M", 1024, 1536, 8, "Q5_K"),
                          ("Q8_0", 2048, 2304, 16, "Q8_0"), ("Q4_0", 2304, 2560, 18, "Q4_0")])
def test_decode_on_records_equals_own_conversion(ftype, hidden, inter, heads, kind, tmp_path):
    """On the cuda backend at decode rows, the norms and the activation write x's records for the Q4_K linears
    after them, and at one row for the Q5_K, Q6_K and (sm_90, K of 8 chunks and more; Q4_0 past 8) Q8_0 and Q4_0 ones
    (ops.records_for): the logits are those of each linear converting x itself, bit for bit (every linear's input in
    the records' range), at batch 1 (the int8 form) and 5 (fp16; only Q4_K takes records there)."""
    from minfer import loader
    from minfer.kv_cache import KVCache
    from minfer.model import Transformer
    from minfer.ops import get_backend, reference

    if kind in ("Q8_0", "Q4_0") and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip(f"{kind} reads x's records on sm_90")
    src = tmp_path / "hf"
    build_llama(src, hidden=hidden, inter=inter, heads=heads)
    out = tmp_path / f"model.{ftype}.gguf"
    quantize_cli([src, out, "--type", ftype])
    cfg, weights, _ = loader.load(str(out), torch.bfloat16, "cuda")
    assert weights["model.layers.0.mlp.gate_proj.weight"].kind == kind
    for batch in (1, 5):
        ids = torch.randint(0, VOCAB, (batch, 9), generator=torch.Generator().manual_seed(batch)).cuda()
        logits = []
        for own_conversion in (False, True):
            ops = get_backend("cuda", "cuda")
            if own_conversion:
                ops.records_for = reference.records_for
            model = Transformer(cfg, weights, ops, 64)
            takes = not own_conversion and (kind == "Q4_K" or batch == 1)
            assert (ops.records_for(ids.new_empty(batch, hidden, dtype=torch.bfloat16), model.layers[0]["gate_up"])
                    is not None) == takes
            cache = KVCache(cfg.num_layers, batch, 64, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
            start = torch.zeros(batch, dtype=torch.int32, device="cuda")
            model.forward(ids[:, :8], start, cache)  # prefill: 8 rows (records) and 40 (none)
            logits.append(model.forward(ids[:, 8:], start + 8, cache))  # decode: batch rows
        assert not torch.isnan(logits[0]).any()
        assert torch.equal(logits[0], logits[1])
        # each tensor on its own format's kernel, against the reference backend on the same blocks: its error from
        # the fp32 logits at most 2x the bf16 reference's (torch's own) + eps
        ref32, ref16 = (_decode_logits(out, ids, dtype) for dtype in (torch.float32, torch.bfloat16))
        err, base = (logits[0].float() - ref32).abs().max().item(), (ref16.float() - ref32).abs().max().item()
        assert err <= 2 * base + 1e-2, f"{ftype} at batch {batch}: max err {err:.3e} vs torch's {base:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_on_the_cuda_backend(arch, tmp_path):
    """A Q4_K_M Qwen file on the quantized kernels (Qwen2's biases in them, Qwen3's q/k norms before rope): the
    decode step's error from the fp32 reference at most 2x the bf16 reference's (torch's own) + eps."""
    src = tmp_path / "hf"
    build_qwen(src, arch, hidden=256, inter=512)  # head_dim 64 (Qwen2) and 128 (Qwen3): the attention kernels'
    out = tmp_path / f"{arch}.Q4_K_M.gguf"
    quantize_cli([src, out, "--type", "Q4_K_M"])
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3)).cuda()
    ours = _decode_logits(out, ids, torch.bfloat16, "cuda")
    ref32, ref16 = (_decode_logits(out, ids, dtype) for dtype in (torch.float32, torch.bfloat16))
    assert not torch.isnan(ours).any()
    err, base = (ours.float() - ref32).abs().max().item(), (ref16.float() - ref32).abs().max().item()
    assert err <= 2 * base + 1e-2, f"{arch}: max err {err:.3e} vs torch's {base:.3e}"


def _decode_logits(path, ids, dtype, backend="ref"):
    """A backend's decode-step logits after an 8-token prefill, the file's blocks dequantized in dtype on ref."""
    from minfer import loader
    from minfer.kv_cache import KVCache
    from minfer.model import Transformer
    from minfer.ops import get_backend

    cfg, weights, _ = loader.load(str(path), dtype, ids.device)
    model = Transformer(cfg, weights, get_backend(backend, ids.device.type), 64)
    batch = ids.shape[0]
    cache = KVCache(cfg.num_layers, batch, 64, cfg.num_kv_heads, cfg.head_dim, dtype, ids.device)
    start = torch.zeros(batch, dtype=torch.int32, device=ids.device)
    model.forward(ids[:, :8], start, cache)
    return model.forward(ids[:, 8:], start + 8, cache)
