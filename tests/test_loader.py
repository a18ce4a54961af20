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
