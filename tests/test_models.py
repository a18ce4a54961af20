"""Random tiny models of every supported architecture vs HF transformers (fp32, CPU, ref backend).

Each test builds an HF model with random weights (norms and biases perturbed away from their
init values), saves it with save_pretrained, loads it back through minfer.loader, and compares
logits over a prefill and KV-cached decode steps with HF's forward and its own cache.
"""
import json
import os
import zlib

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from minfer import loader
from minfer.errors import MinferError
from minfer.kv_cache import KVCache
from minfer.model import Transformer
from minfer.ops import get_backend

transformers = pytest.importorskip("transformers")

VOCAB = 96
ATOL = 1e-4  # fp32 on both sides; observed differences are ~1e-6
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.08)

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "llama3_scaling": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=128)),
    # windows shorter than the 16 positions a test runs, so that keys really slide out
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=5,
                                                             max_window_layers=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "smollm_tied": ("LlamaConfig", "LlamaForCausalLM",
                    dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=4)),
}


def write_tokenizer(folder, vocab=VOCAB):
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))


def build_hf(case, folder, seed=0, shard=False):
    cfg_cls, model_cls, extra = CASES[case]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # all ones at init: a bug that ignores norm weights would pass
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):  # zeros at init
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "100MB")
    write_tokenizer(folder)
    return model


def load_minfer(folder, batch, capacity=64):
    cfg, weights, tok = loader.load(str(folder), torch.float32, "cpu")
    model = Transformer(cfg, weights, get_backend("ref", "cpu"), capacity)
    cache = KVCache(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    return cfg, model, cache, tok


def hf_logits(model, prompt, steps):
    """Prefill logits [len, vocab], then one [vocab] per teacher-forced decode token, via HF's cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for t in steps:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(rows)


@pytest.mark.parametrize("case", list(CASES))
def test_single_sequence_prefill_and_decode(case, tmp_path):
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    hf = build_hf(case, tmp_path, seed=len(case), shard=case in ("llama", "smollm_tied"))
    if case in ("llama", "smollm_tied"):
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
        assert len(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]) > 0
        assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    cfg, model, cache, _ = load_minfer(tmp_path, batch=1)
    assert cfg.tie_word_embeddings == (case == "smollm_tied")
    prompt = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    steps = torch.randint(0, VOCAB, (5,), generator=gen).tolist()

    ours = [model.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int32), cache)[0]]
    for i, t in enumerate(steps):
        start = torch.tensor([len(prompt) + i], dtype=torch.int32)
        ours.append(model.forward(torch.tensor([[t]]), start, cache)[:, 0])
    ours = torch.cat(ours)
    ref = hf_logits(hf, prompt, steps)
    assert ours.shape == ref.shape == (len(prompt) + len(steps), VOCAB)
    assert ref.abs().max() > 0.5  # logits carry signal, so the tolerance is meaningful
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_norms_in_linears_match_hf(case, tmp_path):
    """The layer loop whose linears take the norms and residual adds (Transformer._layers_norms_in_linears, the cuda
    backend's for a small quantized model) on the reference backend's ops, which compose them: the same logits as
    HF's, biases (Qwen2) included."""
    gen = torch.Generator().manual_seed(7)
    hf = build_hf(case, tmp_path, seed=3)
    cfg, model, cache, _ = load_minfer(tmp_path, batch=1)
    model.ops.norms_in_linears = lambda x, weights: True
    prompt = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    steps = torch.randint(0, VOCAB, (3,), generator=gen).tolist()
    ours = [model.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int32), cache)[0]]
    for i, t in enumerate(steps):
        ours.append(model.forward(torch.tensor([[t]]), torch.tensor([len(prompt) + i], dtype=torch.int32), cache)[:, 0])
    assert model._fused_norms and all(model._fused_norms.values())
    torch.testing.assert_close(torch.cat(ours), hf_logits(hf, prompt, steps), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama3_scaling", "qwen2", "qwen3", "mistral_window"])
def test_ragged_batch_matches_each_sequence_alone(case, tmp_path):
    gen = torch.Generator().manual_seed(1234 + len(case))
    hf = build_hf(case, tmp_path, seed=7)
    _, model, cache, _ = load_minfer(tmp_path, batch=2)
    lens = [9, 4]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]
    steps = [torch.randint(0, VOCAB, (3,), generator=gen).tolist() for _ in lens]
    ids = torch.full((2, max(lens)), VOCAB - 1)  # right-padded with a real token id
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    prefill = model.forward(ids, torch.zeros(2, dtype=torch.int32), cache)  # [2, seq, vocab]
    last = model.forward(ids, torch.zeros(2, dtype=torch.int32), cache, logit_index=torch.tensor(lens) - 1)
    decode = []
    for i in range(3):
        step_ids = torch.tensor([[steps[0][i]], [steps[1][i]]])
        decode.append(model.forward(step_ids, torch.tensor(lens, dtype=torch.int32) + i, cache)[:, 0])
    for b in range(2):
        ref = hf_logits(hf, prompts[b], steps[b])
        n = lens[b]
        torch.testing.assert_close(prefill[b, :n], ref[:n], atol=ATOL, rtol=0)
        torch.testing.assert_close(last[b], ref[n - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.stack([d[b] for d in decode]), ref[n:], atol=ATOL, rtol=0)


def test_engine_greedy_matches_hf_generate(tmp_path):
    from minfer.engine import Engine
    from minfer.sampling import SamplingParams

    hf = build_hf("qwen3", tmp_path, seed=3)
    engine = Engine(str(tmp_path), device="cpu", backend="ref")
    gen = torch.Generator().manual_seed(99)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (6, 3)]
    outs, stats = engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=12)
    eos = set(engine.tokenizer.stop_ids)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        cut = next((i for i, t in enumerate(ref) if t in eos), len(ref))
        assert out.token_ids == ref[:cut]
        assert out.finish_reason == ("stop" if cut < len(ref) else "length")
        assert out.text == " ".join(f"w{t}" for t in out.token_ids)
    assert stats.prompt_tokens == 9


def test_kv_cache_overflow_is_a_clear_error(tmp_path):
    build_hf("llama", tmp_path, seed=1)
    _, model, cache, _ = load_minfer(tmp_path, batch=1, capacity=8)
    with pytest.raises(MinferError, match="KV cache"):
        model.forward(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, dtype=torch.int32), cache)
    model.forward(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, dtype=torch.int32), cache)  # exactly fits
    with pytest.raises(MinferError, match="KV cache"):
        model.forward(torch.zeros(1, 1, dtype=torch.long), torch.tensor([8], dtype=torch.int32), cache)


def test_hf_config_fields(tmp_path):
    build_hf("mistral", tmp_path, seed=2)
    cfg, _, _, tok = load_minfer(tmp_path, batch=1)
    assert (cfg.arch, cfg.sliding_window, cfg.num_kv_heads, cfg.head_dim) == ("mistral", 128, 2, 16)
    assert tok.encode("w5 w7 w95") == [5, 7, 95]
    build_hf("qwen3", tmp_path / "q3", seed=2)
    cfg, *_ = load_minfer(tmp_path / "q3", batch=1)
    assert (cfg.arch, cfg.qk_norm, cfg.attention_bias, cfg.head_dim) == ("qwen3", True, False, 24)
    build_hf("qwen2_window", tmp_path / "q2", seed=2)
    cfg, *_ = load_minfer(tmp_path / "q2", batch=1)
    assert (cfg.sliding_window, cfg.layer_types) == (5, ["full_attention", "sliding_attention"])
    build_hf("llama3_scaling", tmp_path / "l3", seed=2)
    cfg, *_ = load_minfer(tmp_path / "l3", batch=1)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0


# ---- config.json as HF writes it, and as users break it ----

def hf_config(**changes):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def test_config_model_type_stands_in_for_architectures():
    from minfer.config import ModelConfig
    assert ModelConfig.from_hf(hf_config(architectures=None)).arch == "llama"
    assert ModelConfig.from_hf(hf_config(architectures=None, model_type="qwen3")).qk_norm
    with pytest.raises(MinferError, match="gpt2"):
        ModelConfig.from_hf(hf_config(architectures=None, model_type="gpt2"))
    with pytest.raises(MinferError, match="GPT2LMHeadModel"):  # a named architecture is not second-guessed
        ModelConfig.from_hf(hf_config(architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("key,value", [("num_attention_heads", 0), ("hidden_size", -64), ("num_hidden_layers", "2"),
                                       ("num_key_value_heads", 0), ("head_dim", 1.5), ("vocab_size", None)])
def test_config_bad_sizes_are_named(key, value):
    from minfer.config import ModelConfig
    with pytest.raises(MinferError, match=key):
        ModelConfig.from_hf(hf_config(**{key: value}))


@pytest.mark.parametrize("key,value", [
    ("rms_norm_eps", "1e-5"), ("rope_theta", float("nan")), ("rope_theta", -1.0), ("partial_rotary_factor", 2.0),
    ("max_position_embeddings", 1e3), ("tie_word_embeddings", "false"), ("attention_bias", 1),
    ("eos_token_id", [2, "3"]), ("bos_token_id", -1), ("rope_scaling", [8.0]), ("sliding_window", "4096"),
    ("layer_types", "full_attention")])
def test_config_fields_of_the_wrong_type_are_named(key, value):
    """A value of the wrong type is an error naming its field, not a silent default (bool("false") is True)
    nor a TypeError in the model's set-up."""
    from minfer.config import ModelConfig
    with pytest.raises(MinferError, match=f"config.json: {key} is"):
        ModelConfig.from_hf(hf_config(**{key: value}))


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "llama3", "factor": "8"}, "rope_scaling.factor is"),
    ({"rope_type": "linear"}, "needs a positive factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}, "below high_freq"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192.5}, "original_max_position")])
def test_config_bad_rope_scaling_is_named(scaling, message):
    from minfer.config import ModelConfig
    with pytest.raises(MinferError, match=message):
        ModelConfig.from_hf(hf_config(rope_scaling=scaling))


def test_config_nulls_are_defaults():
    from minfer.config import ModelConfig
    cfg = ModelConfig.from_hf(hf_config(rms_norm_eps=None, tie_word_embeddings=None, max_position_embeddings=None)
                              | {"rms_norm_eps": None, "tie_word_embeddings": None, "max_position_embeddings": None})
    assert (cfg.rms_norm_eps, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (1e-6, False, 4096)


def test_config_that_is_not_an_object():
    from minfer.config import ModelConfig
    with pytest.raises(MinferError, match="config.json.*not an object"):
        ModelConfig.from_hf([hf_config()])
