"""Gemma 3 against HF transformers (fp32, CPU, ref backend): a random tiny model with local (windowed) and
global layers, prompts longer than the window so that the local layers really drop keys; the layer pattern
and RoPE bases from both HF config spellings and from GGUF metadata; the real gemma-3-270m GGUF when present."""
import math
import os
from types import SimpleNamespace

import pytest
import torch

from minfer import fetch, gguf, loader
from minfer.config import FULL, SLIDING, ModelConfig

from test_models import hf_logits, load_minfer, write_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW = 96, 8
ATOL = 1e-4
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING]
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=WINDOW,
              layer_types=LAYER_TYPES, query_pre_attn_scalar=24, initializer_range=0.08,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                               FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}})


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # zeros at init (the multiplier 1 + w is 1): a bug in the offset would pass
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder, model


def test_config(hf_folder):
    cfg, *_ = load_minfer(hf_folder[0], batch=1)
    assert (cfg.arch, cfg.layer_types, cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == \
        ("gemma3", LAYER_TYPES, WINDOW, 5000.0, 100.0)
    assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_scaling["factor"] == 2.0
    assert cfg.attention_scale == 24 ** -0.5 and cfg.embed_scale == 8.0 and cfg.tie_word_embeddings
    assert [cfg.window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]


def test_prefill_and_decode_past_the_window(hf_folder):
    folder, hf = hf_folder
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (13,), generator=gen).tolist()  # past the window already in prefill
    steps = torch.randint(0, VOCAB, (10,), generator=gen).tolist()
    _, model, cache, _ = load_minfer(folder, batch=1)
    ours = [model.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int32), cache)[0]]
    for i, t in enumerate(steps):
        ours.append(model.forward(torch.tensor([[t]]), torch.tensor([len(prompt) + i], dtype=torch.int32), cache)[:, 0])
    ours = torch.cat(ours)
    ref = hf_logits(hf, prompt, steps)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # The window matters here: the same model without it is far off past position WINDOW.
    model.windows = [None] * 4
    full = model.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int32), cache)[0]
    assert (full[WINDOW:] - ref[WINDOW:len(prompt)]).abs().max() > 100 * ATOL
    torch.testing.assert_close(full[:WINDOW], ref[:WINDOW], atol=ATOL, rtol=0)


def test_ragged_batch(hf_folder):
    folder, hf = hf_folder
    gen = torch.Generator().manual_seed(2)
    lens = [14, 5]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]
    steps = [torch.randint(0, VOCAB, (6,), generator=gen).tolist() for _ in lens]
    _, model, cache, _ = load_minfer(folder, batch=2)
    ids = torch.full((2, max(lens)), VOCAB - 1)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    prefill = model.forward(ids, torch.zeros(2, dtype=torch.int32), cache)
    decode = [model.forward(torch.tensor([[steps[0][i]], [steps[1][i]]]), torch.tensor(lens, dtype=torch.int32) + i,
                            cache)[:, 0] for i in range(6)]
    for b, n in enumerate(lens):
        ref = hf_logits(hf, prompts[b], steps[b])
        torch.testing.assert_close(prefill[b, :n], ref[:n], atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.stack([d[b] for d in decode]), ref[n:], atol=ATOL, rtol=0)


def test_continuous_engine_greedy_matches_hf_generate(hf_folder):
    """Paged attention with the window: pages of 4, prefill in chunks of 8, two sequences at a time."""
    from minfer import LLM

    folder, hf = hf_folder
    llm = LLM(str(folder), dtype="float32", device="cpu", backend="ref", max_model_len=64, block_size=4,
              num_pages=64, max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (19, 4, 11)]
    assert_greedy_matches_hf(llm, hf, prompts, 14)


def assert_greedy_matches_hf(llm, hf, prompts, n):
    """The engine's n greedy tokens after each prompt (one batch) equal transformers' generate, prompt by prompt."""
    from minfer import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert out.token_ids == ref


def test_float16_is_refused(hf_folder):
    """Gemma 3's activations overflow float16 (the real 270m gives NaN logits from the first token on, on the
    reference as on the kernels): a clear error, not garbage."""
    from minfer.engine import LoadedModel
    from minfer.errors import MinferError
    with pytest.raises(MinferError, match="Gemma 3 overflows float16"):
        LoadedModel(str(hf_folder[0]), dtype=torch.float16, device="cpu", backend="ref")


def test_hf_config_spellings():
    """transformers 4's config.json: rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern."""
    hf = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, rope_theta=1e6,
              rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=3,
              query_pre_attn_scalar=256)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.arch == "gemma3" and cfg.layer_types == [SLIDING, SLIDING, FULL] * 2 + [SLIDING, SLIDING]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    del hf["sliding_window_pattern"]  # the default: every 6th layer global
    assert ModelConfig.from_hf(hf).layer_types == [SLIDING] * 5 + [FULL] + [SLIDING] * 2
    assert ModelConfig.from_hf({**hf, "architectures": ["Gemma3ForCausalLM"]}).arch == "gemma3"


def fake_reader(**meta):
    fields = {"general.architecture": "gemma3", "gemma3.embedding_length": 640, "gemma3.attention.head_count": 4,
              "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256, "gemma3.block_count": 8,
              "gemma3.feed_forward_length": 2048, "gemma3.attention.sliding_window": 512,
              "gemma3.rope.freq_base": 1e6, "gemma3.vocab_size": VOCAB, **{f"gemma3.{k}": v for k, v in meta.items()}}
    return SimpleNamespace(fields=fields, tensors=[])


def test_gguf_layer_pattern():
    """llama.cpp's rule: layer i is local unless i % 6 == 5; a sliding_window_pattern key overrides it."""
    cfg = gguf.read_config(fake_reader())
    assert cfg.layer_types == [SLIDING] * 5 + [FULL] + [SLIDING] * 2
    assert (cfg.sliding_window, cfg.rope_local_theta, cfg.attention_scale, cfg.embed_scale) == \
        (512, 10000.0, 256 ** -0.5, 640 ** 0.5)
    assert cfg.tie_word_embeddings and cfg.sandwich_norm and cfg.qk_norm and cfg.hidden_act == "gelu_tanh"
    assert gguf.read_config(fake_reader(**{"attention.sliding_window_pattern": 4})).layer_types == \
        [SLIDING] * 3 + [FULL] + [SLIDING] * 3 + [FULL]
    pattern = [True, False] * 4
    cfg = gguf.read_config(fake_reader(**{"attention.sliding_window_pattern": pattern, "rope.freq_base_swa": 5e3}))
    assert cfg.layer_types == [SLIDING, FULL] * 4 and cfg.rope_local_theta == 5e3


GGUF_PATH = os.environ.get("MINFER_GEMMA3_GGUF",
                           os.path.join(loader.cache_dir(), fetch.MODELS["gemma3-270m"].file))  # setup.sh --model
needs_real_file = pytest.mark.skipif(not os.path.exists(GGUF_PATH), reason=f"gemma-3-270m GGUF not at {GGUF_PATH} "
                                     "(bash setup.sh --model gemma3-270m)")


@needs_real_file
def test_real_gguf_greedy_matches_transformers():
    """The first 16 greedy tokens of a prompt equal transformers' on the same file, fp32 (both dequantize
    it); about a minute, most of it transformers reading the file. The tokenizer is held to transformers'
    in test_sentencepiece.py; here the prompt's ids are the ones transformers' GGUF tokenizer gives."""
    pytest.importorskip("accelerate")
    from minfer.engine import Engine
    from minfer.sampling import SamplingParams

    engine = Engine(GGUF_PATH, dtype=torch.float32, device="cpu", backend="ref", max_context=64)
    ids = engine.encode("The capital of France is", chat=False)
    assert ids == [2, 818, 5279, 529, 7001, 563]
    assert engine.tokenizer.tok.token_to_id("<end_of_turn>") in engine.tokenizer.stop_ids
    # the file has no chat template: Gemma's own is used
    assert engine.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}]) == \
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    outs, _ = engine.generate([ids], SamplingParams(temperature=0.0), max_new_tokens=16, ignore_eos=True)
    assert "France" in outs[0].text
    folder, name = os.path.split(GGUF_PATH)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):]
    assert outs[0].token_ids == ref.tolist()


def test_cuda_backend_lists_what_gemma_runs_on_ref(capsys):
    """On a backend whose kernels lack an op the model needs, the op runs on ref and is named (checked on a
    stand-in backend, as the cuda one needs a GPU)."""
    from minfer.ops import Backend, reference
    ops = Backend("cuda", {"attention": None, "gelu_tanh_and_mul": reference.gelu_tanh_and_mul}, [],
                  ("gelu_tanh_and_mul",))
    assert ops.fallbacks == []  # a Llama never lists GeGLU
    ops.need("gelu_tanh_and_mul")
    ops.route_to_reference("attention", "no kernel for head_dim 256 yet")
    ops.route_to_reference("attention", "said once")
    assert ops.fallbacks == ["gelu_tanh_and_mul", "attention"] and ops.attention is reference.attention
    assert capsys.readouterr().err == "minfer: attention runs on the reference backend: no kernel for head_dim 256 yet\n"


def _hf_real():
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    folder, name = os.path.split(GGUF_PATH)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.gpu
@needs_real_file
def test_real_gguf_on_cuda_kernels_matches_transformers():
    """Every layer on our kernels (head_dim 256, windowed attention, GeGLU, Q4_K / Q6_K / Q8_0 weights kept
    quantized), bf16 (fp16 overflows: test_float16_is_refused): the first 8 greedy tokens equal transformers'
    fp32 on the same file."""
    from minfer.engine import Engine
    from minfer.quant import QuantizedWeight
    from minfer.sampling import SamplingParams

    engine = Engine(GGUF_PATH, dtype=torch.bfloat16, device="cuda", backend="cuda", max_context=1024)
    assert engine.ops.fallbacks == [] and any(engine.model.windows)
    assert isinstance(engine.model.layers[0]["down"], QuantizedWeight)
    ids = engine.encode("The capital of France is", chat=False)
    outs, _ = engine.generate([ids], SamplingParams(temperature=0.0), max_new_tokens=8, ignore_eos=True)
    with torch.no_grad():
        ref = _hf_real().generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    print(f"minfer cuda bf16: {outs[0].text!r}; transformers fp32: {engine.tokenizer.decode(ref[0, len(ids):].tolist())!r}")
    assert outs[0].token_ids == ref[0, len(ids):].tolist()
    # The continuous engine (paged kernels, decode graphs, the windowed layers' own page pool) on the same
    # prompt, and on one past the 512-key window (pages freed as it slides) against the static engine.
    from minfer import LLM
    llm = LLM(GGUF_PATH, dtype=torch.bfloat16, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256)
    long_ids = ids + engine.encode(" Paris is the capital of France." * 100, chat=False)[:700]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": long_ids}], params)
    static, _ = engine.generate([ids, long_ids], SamplingParams(temperature=0.0), max_new_tokens=8, ignore_eos=True)
    assert got[0].token_ids[:8] == ref[0, len(ids):].tolist()
    # the same 8 tokens through other kernels (paged, in chunks of 256) as the static engine
    assert [o.token_ids for o in got] == [o.token_ids for o in static]


@pytest.mark.gpu
@needs_real_file
def test_real_gguf_perplexity_within_1_percent_of_transformers():
    """tinyshakespeare, 8 windows of 1024 tokens (past the 512-key window of the local layers), each one
    prefill on our kernels (bf16) against transformers fp32 on the GPU."""
    from test_quantized_engine import TEXT
    from minfer.engine import Engine

    if not os.path.exists(TEXT):
        pytest.skip(f"no {TEXT} (set MINFER_TINYSHAKESPEARE)")
    engine = Engine(GGUF_PATH, dtype=torch.bfloat16, device="cuda", backend="cuda", max_context=1024)
    hf = _hf_real().cuda()
    with open(TEXT, encoding="utf-8") as f:
        ids = engine.tokenizer.encode(f.read()[:100_000])
    length, windows = 1024, 8
    assert len(ids) >= windows * length
    cache = engine._cache_rows(1, length)
    loss = {"minfer": 0.0, "transformers": 0.0}
    with torch.inference_mode():
        for w in range(windows):
            chunk = torch.tensor(ids[w * length:(w + 1) * length], device="cuda")[None]  # [1, length]
            ours = engine.model.forward(chunk, torch.zeros(1, dtype=torch.int32, device="cuda"), cache)[0]
            theirs = hf(chunk).logits[0]
            for name, logits in (("minfer", ours), ("transformers", theirs)):
                loss[name] += torch.nn.functional.cross_entropy(logits[:-1].float(), chunk[0, 1:], reduction="sum").item()
    ppl = {k: math.exp(v / (windows * (length - 1))) for k, v in loss.items()}
    print(f"gemma-3-270m Q4_K_M perplexity, tinyshakespeare, {windows} x {length} tokens: {ppl}")
    assert 1 < ppl["transformers"] < 1000
    assert abs(ppl["minfer"] / ppl["transformers"] - 1) <= 0.01, ppl


# A random tiny Gemma 3 as llama.cpp's convert_hf_to_gguf.py writes one (F32), read by minfer and by
# transformers' own GGUF loader. Of gemma3's metadata transformers reads only rope.freq_base, the window and
# the sizes: the layer pattern, the local RoPE base and query_pre_attn_scalar are its config's defaults (every
# 6th layer global, 10000, 256), which are also llama.cpp's rule when no key says otherwise and head_dim is
# 256; so the file has 7 layers (5 local, 1 global, 1 local) and head_dim 256 (not hidden / heads = 32).
GGUF_LAYERS, GGUF_WINDOW = 7, 6
GGUF_TYPES = [SLIDING] * 5 + [FULL, SLIDING]
GGUF_CONFIG = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=GGUF_LAYERS, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=256, max_position_embeddings=128, sliding_window=GGUF_WINDOW,
                   query_pre_attn_scalar=256, rms_norm_eps=1e-6, initializer_range=0.08,
                   rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                    FULL: {"rope_type": "default", "rope_theta": 5000.0}})


def write_gemma3_gguf(path, hf, vocab):
    """convert_hf_to_gguf.py's Gemma3Model (TextModel.set_gguf_parameters, then its own; _set_vocab_sentencepiece):
    HF names mapped by gguf's tensor table for MODEL_ARCH.GEMMA3, every *norm.weight stored as 1 + w, Q/K rows
    as they are (no llama permutation), no output.weight (tied), no vocab_size and no layer-pattern key."""
    import gguf as gguf_py
    tokens, scores, types, ids = vocab
    c = hf.config
    w = gguf_py.GGUFWriter(str(path), "gemma3")
    w.add_type("model")
    w.add_name("Tiny Gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters[FULL]["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters[SLIDING]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf_py.LlamaFileType.ALL_F32)
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    w.add_unk_token_id(ids["unknown"])
    w.add_pad_token_id(ids["padding"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    names = gguf_py.get_tensor_name_map(gguf_py.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: save_pretrained leaves it out, and so does the file
        base, suffix = name.rsplit(".", 1)
        x = p.detach().float() + (1.0 if name.endswith("norm.weight") else 0.0)
        w.add_tensor(names.get_name(base) + "." + suffix, x.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    from test_sentencepiece import gemma_vocab
    vocab = gemma_vocab()
    torch.manual_seed(5)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(vocab_size=len(vocab[0]), **GGUF_CONFIG))
    hf = hf.float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # zeros at init: a file without the + 1, or a reader that adds another, would pass
                p.copy_(0.3 * torch.randn_like(p))
    assert hf.config.layer_types == GGUF_TYPES
    path = tmp_path_factory.mktemp("gemma3_gguf") / "tiny-gemma3-f32.gguf"
    write_gemma3_gguf(path, hf, vocab)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    return path, hf, theirs


def test_llama_cpp_gguf_matches_transformers(gemma3_gguf):
    """The same F32 file through minfer and through transformers' GGUF loader: config, norms, the tied and
    scaled embedding, the windowed layers (a prompt past the window), decode steps; and the tokenizer."""
    path, original, theirs = gemma3_gguf
    vocab = original.config.vocab_size
    # transformers read the file as written: its config is the original's, its weights the original's
    assert theirs.config.layer_types == GGUF_TYPES and theirs.config.sliding_window == GGUF_WINDOW
    assert theirs.config.tie_word_embeddings and theirs.config.query_pre_attn_scalar == 256
    ref_state = original.state_dict()
    for name, p in theirs.state_dict().items():
        torch.testing.assert_close(p, ref_state[name], atol=1e-6, rtol=0, msg=name)  # (w + 1) - 1 rounds

    cfg, model, cache, tok = load_minfer(path, batch=1)
    assert (cfg.arch, cfg.num_layers, cfg.layer_types, cfg.sliding_window) == \
        ("gemma3", GGUF_LAYERS, GGUF_TYPES, GGUF_WINDOW)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (5000.0, 10000.0, None)
    assert cfg.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)  # a float32 in the file
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (256, 2, 1, vocab)
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embed_scale == 8.0 and cfg.tie_word_embeddings
    assert [model.windows[i] for i in range(GGUF_LAYERS)] == [GGUF_WINDOW] * 5 + [None, GGUF_WINDOW]

    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, vocab, (15,), generator=gen).tolist()  # past the window in prefill
    steps = torch.randint(0, vocab, (6,), generator=gen).tolist()
    ours = [model.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int32), cache)[0]]
    for i, t in enumerate(steps):
        ours.append(model.forward(torch.tensor([[t]]), torch.tensor([len(prompt) + i], dtype=torch.int32), cache)[:, 0])
    ours = torch.cat(ours)
    ref = hf_logits(theirs, prompt, steps)
    assert ours.shape == ref.shape == (len(prompt) + len(steps), vocab)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(ref, hf_logits(original, prompt, steps), atol=ATOL, rtol=0)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)
    # the window matters: without it the local layers are far off past position GGUF_WINDOW
    model.windows = [None] * GGUF_LAYERS
    full = model.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int32), cache)[0]
    assert (full[GGUF_WINDOW:] - ref[GGUF_WINDOW:len(prompt)]).abs().max() > 100 * ATOL

    their_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b"):
        ids = tok.encode(text)
        assert ids[0] == 2 and ids == their_tok.encode(text), text


def test_llama_cpp_gguf_continuous_engine_greedy_matches_transformers(gemma3_gguf):
    """The file through the continuous engine (paged, windowed pages of 4, prefill in chunks of 8)."""
    from minfer import LLM

    path, _, theirs = gemma3_gguf
    llm = LLM(str(path), dtype="float32", device="cpu", backend="ref", max_model_len=64, block_size=4,
              num_pages=64, max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, theirs.config.vocab_size, (n,), generator=gen).tolist() for n in (17, 5)]
    assert_greedy_matches_hf(llm, theirs, prompts, 10)
