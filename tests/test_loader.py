"""Loading, in process: a broken, missing or unreadable file is a MinferError that names it."""
import builtins
import json
import os
import re

import pytest
import torch

from minfer import loader
from minfer.errors import MinferError
from test_cli import MODEL_PATH, needs_model, write_tiny_hf


def load(path):
    return loader.load(str(path), torch.float32, "cpu")


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_hf(str(tmp_path / "tiny"))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json",
                                  "tokenizer_config.json", "tokenizer.json"])
def test_broken_file_is_named(tiny, name):
    path = os.path.join(tiny, name)
    with open(path, "w") as f:
        f.write('{"eos_token_id": [1, ')  # cut off
    with pytest.raises(MinferError, match=re.escape(path)):
        load(tiny)


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json"])
def test_json_that_is_not_an_object_is_named(tiny, name):
    path = os.path.join(tiny, name)
    with open(path, "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(MinferError, match=re.escape(path) + ".*not an object"):
        load(tiny)


def deny(monkeypatch, denied: str):
    """open() of `denied`, or of anything under it, fails as for a user without read permission (the
    tests run as root, whom chmod does not stop)."""
    real_open = builtins.open

    def open_(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and (os.fspath(file) + os.sep).startswith(denied + os.sep):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)


@pytest.mark.parametrize("name", ["", "model.safetensors", "tokenizer.json", "config.json"])
def test_unreadable_file_says_permission_denied(tiny, monkeypatch, name):
    """name "": the folder itself (every file in it unreadable)."""
    path = os.path.join(tiny, name) if name else tiny
    deny(monkeypatch, path)
    with pytest.raises(MinferError, match=re.escape(path) + ".*permission denied"):
        load(tiny)


@needs_model
def test_unreadable_gguf_says_permission_denied(monkeypatch):
    deny(monkeypatch, MODEL_PATH)
    with pytest.raises(MinferError, match=re.escape(MODEL_PATH) + ": permission denied"):
        load(MODEL_PATH)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_for_real(tiny):
    path = os.path.join(tiny, "model.safetensors")
    os.chmod(path, 0)
    try:
        with pytest.raises(MinferError, match="permission denied"):
            load(tiny)
    finally:
        os.chmod(path, 0o644)


def test_config_that_is_a_list_is_named(tiny):
    path = os.path.join(tiny, "config.json")
    with open(path, "w") as f:
        json.dump([{"architectures": ["LlamaForCausalLM"]}], f)
    with pytest.raises(MinferError, match=re.escape(path) + ".*not an object"):
        load(tiny)


def test_bench_load_writes_and_times_both_checkpoints(tmp_path, capsys):
    """apps/bench_load.py: the shape's random weights as a sharded bf16 HF folder and as a GGUF of the same
    weights, each loaded and timed (on the CPU here; the goal's comparison runs on the GPU)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps", "bench_load.py")
    spec = importlib.util.spec_from_file_location("bench_load", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.SHARD_BYTES = 64 << 20  # several shards and their index
    out = tmp_path / "load.jsonl"
    assert bench.main(["--shape", "smollm2-135m", "--type", "Q8_0", "--device", "cpu", "--dir", str(tmp_path),
                       "--reps", "1", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["checkpoint"] for r in rows] == ["HF folder, bf16", "GGUF, Q8_0"]
    assert all(r["load_s"] > 0 and r["file_gb"] > 0 for r in rows)
    assert rows[1]["device_gb"] < 0.6 * rows[0]["device_gb"]  # Q8_0 blocks stay quantized: 8.5 bits against 16
    folder = rows[0]["path"]
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    from minfer import quantize
    cfg, weights, tok = loader.load(folder, torch.bfloat16, "cpu")
    name = "model.layers.3.mlp.down_proj.weight"  # the weights minfer.quantize --shape writes
    assert torch.equal(weights[name], quantize.shape_source("smollm2-135m", "cpu").read(name).to(torch.bfloat16))
    assert tok.encode("hello world") and cfg.num_layers == 30
    assert "the GGUF loads in" in capsys.readouterr().out


def rewrite_tiny(folder, config=None, tensors=None, drop=()):
    """The tiny folder with config.json keys replaced, tensors replaced or added, and tensors dropped."""
    from safetensors.torch import load_file, save_file
    if config:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump({**cfg, **config}, f)
    path = os.path.join(folder, "model.safetensors")
    w = {k: v for k, v in load_file(path).items() if k not in drop}
    save_file({**w, **(tensors or {})}, path)


@pytest.mark.parametrize("change,message", [
    (dict(tensors={"model.layers.1.mlp.down_proj.weight": torch.randn(48, 32)}),
     r"model.layers.1.mlp.down_proj.weight has shape \[48, 32\]; the config needs \[32, 48\]"),
    (dict(tensors={"model.layers.0.input_layernorm.weight": torch.ones(1)}), r"input_layernorm.weight has shape \[1\]"),
    (dict(tensors={"lm_head.weight": torch.randn(100, 32)}), r"lm_head.weight has shape \[100, 32\]"),
    (dict(config={"num_hidden_layers": 1}), "has tensors of layer 1, but the config's layer count is 1"),
    (dict(config={"num_hidden_layers": 3}), "has no tensors of layer 2; the config's layer count is 3"),
    (dict(drop=["model.layers.1.self_attn.v_proj.weight"]), "missing 1 tensors, e.g. model.layers.1.self_attn.v_proj"),
    # refused before any table of that size is made
    (dict(config={"head_dim": 10 ** 8}), r"has shape \[16, 32\]; the config needs \[200000000, 32\]"),
    (dict(config={"vocab_size": 32}), "the tokenizer has 64 tokens, more than the model's vocab_size 32"),
    (dict(config={"vocab_size": 1000}), r"has shape \[64, 32\]; the config needs \[1000, 32\]"),
    (dict(config={"eos_token_id": 5000, "vocab_size": 64}), "EOS token id 5000 is past"),
    (dict(tensors={"model.layers.0.self_attn.q_proj.weight": torch.full((32, 32), float("nan"))}),
     "model.layers.0.self_attn.q_proj.weight holds NaN or Inf"),
    (dict(tensors={"model.norm.weight": torch.full((32,), float("inf"))}), "model.norm.weight holds NaN or Inf"),
    (dict(config={"quantization_config": {"quant_method": "fp8"}}), r"quantized safetensors \(fp8\) are not supported"),
    (dict(tensors={"model.layers.0.mlp.up_proj.weight": torch.zeros(48, 32, dtype=torch.int64)}),
     "up_proj.weight is I64"),
])
def test_a_checkpoint_its_config_does_not_describe_is_refused(tiny, change, message):
    """Shapes, layer count, vocabulary, finiteness and dtype are checked at load, each error naming the tensor or
    the field: none of these may run (garbage, dropped layers, an index past the embedding) or fail in torch."""
    rewrite_tiny(tiny, **change)
    with pytest.raises(MinferError, match=message):
        load(tiny)


def test_generation_config_eos_of_the_wrong_type_is_named(tiny):
    with open(os.path.join(tiny, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": "w1"}, f)
    with pytest.raises(MinferError, match="generation_config.json: eos_token_id is 'w1'"):
        load(tiny)


def test_checkpoint_argument_forms(tiny, tmp_path):
    import pathlib
    assert load(pathlib.Path(tiny))[0].num_layers == 2  # a Path is a path
    with pytest.raises(MinferError, match="not int"):
        loader.resolve(123)
    with pytest.raises(MinferError, match="empty name"):
        loader.resolve("")
    with pytest.raises(MinferError, match="models/smol.gguf: no such file"):  # a file's name, never a hub id
        loader.resolve("models/smol.gguf")


def fake_hub(monkeypatch, tmp_path, files: dict[str, str | None]):
    """huggingface_hub.snapshot_download over a repository of these files (path -> a file to link, or None for an
    empty one): the snapshot holds those its allow_patterns match, as the hub's would; the patterns asked for."""
    import fnmatch

    import huggingface_hub
    asked = []

    def snapshot_download(repo, allow_patterns):
        asked.append(allow_patterns)
        folder = tmp_path / "snapshot" / repo
        for name, source in files.items():
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                if source is None:
                    (folder / name).touch()
                elif not (folder / name).exists():
                    os.symlink(source, folder / name)
        folder.mkdir(parents=True, exist_ok=True)
        return str(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return asked


@needs_model
def test_a_hub_gguf_by_its_type(monkeypatch, tmp_path):
    """repo:TYPE (llama.cpp's -hf form, vLLM's too) fetches that type's GGUF alone, or a split model's files, and
    loads it; Q4_K takes no Q4_K_M or IQ4_K; none or two such models are errors listing what was found."""
    files = {"smol-Q4_1.gguf": MODEL_PATH, "smol-Q4_K_M.gguf": None, "smol-IQ4_K.gguf": None, "smol-Q4_K.gguf": None,
             "Q8_0/smol-Q8_0-00001-of-00002.gguf": None, "Q8_0/smol-Q8_0-00002-of-00002.gguf": None,
             "README.md": None, "a-q6_k.gguf": None, "b-Q6_K.gguf": None}
    asked = fake_hub(monkeypatch, tmp_path, files)
    cfg, _, tok = load("org/smol-GGUF:Q4_1")
    assert cfg.num_layers == 30 and tok.encode("Hi")
    assert os.listdir(tmp_path / "snapshot/org/smol-GGUF") == ["smol-Q4_1.gguf"]  # nothing else fetched
    assert loader.resolve("org/smol-GGUF:q4_k").endswith("/smol-Q4_K.gguf")
    assert sorted(os.listdir(tmp_path / "snapshot/org/smol-GGUF")) == ["smol-Q4_1.gguf", "smol-Q4_K.gguf"]
    assert loader.resolve("org/smol-GGUF:Q8_0").endswith("/Q8_0/smol-Q8_0-00001-of-00002.gguf")
    assert sorted(os.listdir(tmp_path / "snapshot/org/smol-GGUF/Q8_0")) == [
        "smol-Q8_0-00001-of-00002.gguf", "smol-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(MinferError, match="no GGUF file of type Q5_K_M .none found"):
        loader.resolve("org/smol-GGUF:Q5_K_M")
    with pytest.raises(MinferError, match="more than one GGUF file of type Q6_K .a-q6_k.gguf, b-Q6_K.gguf"):
        loader.resolve("org/smol-GGUF:Q6_K")
    with pytest.raises(MinferError, match="a GGUF type is a name such as Q4_K_M"):
        loader.resolve("org/smol-GGUF:*")
    with pytest.raises(MinferError, match="no config.json on the hub; .* as in org/smol-GGUF:Q4_K_M"):
        loader.resolve("org/smol-GGUF")
    assert all(p != "*.gguf" for ps in asked for p in ps), asked


def test_quantized_scales_that_are_not_finite_are_found():
    from minfer.quant import BLOCK_BYTES, QuantizedWeight, SCALE_OFFSETS
    for kind, offsets in SCALE_OFFSETS.items():
        for at in offsets:
            blocks = torch.zeros(32, 256 // (256 if "K" in kind else 32) * BLOCK_BYTES[kind], dtype=torch.uint8)
            w = QuantizedWeight(kind, blocks, (32, 256))
            assert bool(w.finite())
            blocks.view(-1, BLOCK_BYTES[kind])[7, at:at + 2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # NaN
            assert not bool(w.finite()), (kind, at)


def gguf_fields(**changes):
    """A valid llama GGUF's metadata (as read), with changes (None drops a key)."""
    fields = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
              "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.context_length": 256,
              "tokenizer.ggml.tokens": ["a"] * 100}
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not None}


@pytest.mark.parametrize("changes,message", [
    ({"llama.attention.layer_norm_rms_epsilon": -1.0}, "layer_norm_rms_epsilon is -1.0; it must be a positive"),
    ({"llama.rope.freq_base": 0.0}, "rope.freq_base is 0.0"),
    ({"llama.attention.head_count": 0}, "head_count is 0"),
    ({"llama.embedding_length": "64"}, "embedding_length is '64'"),
    ({"llama.rope.scaling.type": "yarn"}, "rope.scaling.type 'yarn'"),
    ({"llama.rope.dimension_count": 128}, "RoPE over"),
    ({"llama.expert_count": 8}, "8 experts a layer"),
])
def test_gguf_metadata_is_checked(changes, message):
    from types import SimpleNamespace
    from minfer import gguf
    assert gguf.read_config(SimpleNamespace(fields=gguf_fields(), tensors=[])).num_layers == 2
    with pytest.raises(MinferError, match=message):
        gguf.read_config(SimpleNamespace(fields=gguf_fields(**changes), tensors=[]))


def test_gguf_bpe_without_merges_is_refused():
    from minfer import gguf
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"]}
    with pytest.raises(MinferError, match="lacks tokenizer.ggml.merges"):
        gguf.tokenizer_from_fields(lambda key, default=None: fields.get(key, default))
