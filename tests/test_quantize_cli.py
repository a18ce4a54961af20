"""python -m minfer.quantize on bad input: a source that does not match its config, an OUT that cannot be written
or would replace the source, a signal mid-way. Each is one line `minfer: error: ...` (or a clean exit) that leaves
no file behind."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from minfer import quantize
from minfer.errors import run_cli

from test_quantize import build_llama, gguf, quantize_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    build_llama(folder)
    return folder


@pytest.fixture
def src(hf_model, tmp_path):
    """A copy of the tiny HF model to spoil, and an empty folder for OUT."""
    (tmp_path / "out").mkdir()
    return shutil.copytree(hf_model, tmp_path / "src")


def error(args, capsys) -> str:
    capsys.readouterr()
    assert quantize.main([str(a) for a in args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minfer: error: "), err
    return err


def edit_weights(folder, fn):
    from safetensors.torch import load_file, save_file

    w = load_file(folder / "model.safetensors")
    fn(w)
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})


def edit_config(folder, **kw):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **kw}))


def replace(name, fn):
    """A spoiler of the source: its tensor `name` becomes fn(tensor) (fn(None): one added)."""
    return lambda folder: edit_weights(folder, lambda w: w.update({name: fn(w.get(name)).contiguous()}))


def set_one(value):
    def fn(x):
        x[3, 5] = value
        return x
    return fn


def truncate(folder):
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)


SPOILED = {  # how the source is spoiled, what the error says
    "missing": (lambda f: edit_weights(f, lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
                "missing 1 tensors, e.g. model.layers.1.mlp.up_proj.weight"),
    "transposed": (replace("model.layers.0.mlp.down_proj.weight", torch.t),
                   "tensor model.layers.0.mlp.down_proj.weight has shape [128, 64]; the config needs [64, 128]"),
    "short embedding": (replace("model.embed_tokens.weight", lambda x: x[:300]),
                        "tensor model.embed_tokens.weight has shape [300, 64]; the config needs [320, 64]"),
    "layers fewer": (lambda f: edit_config(f, num_hidden_layers=1),
                     "has tensors of layer 1, but the config's layer count is 1"),
    "layers more": (lambda f: edit_config(f, num_hidden_layers=100_000_000),
                    "has no tensors of layer 2; the config's layer count is 100000000"),
    "extra bias": (replace("model.layers.0.self_attn.q_proj.bias", lambda x: torch.zeros(64)),
                   "tensor model.layers.0.self_attn.q_proj.bias is not one of a llama model with this config"),
    "nan": (replace("model.layers.1.self_attn.o_proj.weight", set_one(float("nan"))),
            "tensor model.layers.1.self_attn.o_proj.weight holds NaN or Inf"),
    "inf": (replace("lm_head.weight", set_one(float("-inf"))), "tensor lm_head.weight holds NaN or Inf"),
    "truncated": (truncate, "model.safetensors: cannot read safetensors (SafetensorError"),
    "index without weight_map": (lambda f: (f / "model.safetensors.index.json").write_text('{"metadata": {}}'),
                                 "model.safetensors.index.json: no weight_map"),
}


@pytest.mark.parametrize("case", SPOILED)
def test_a_source_that_does_not_match_its_config_writes_nothing(case, src, tmp_path, capsys):
    spoil, message = SPOILED[case]
    spoil(src)
    err = error([src, tmp_path / "out" / "x.gguf", "--type", "Q8_0"], capsys)
    assert str(src) in err and message in err
    assert os.listdir(tmp_path / "out") == []


def write_float_gguf(src_folder, path, edit):
    """SRC as an F32 GGUF (llama.cpp's names and Q/K order), each tensor through edit(GGUF name, x)."""
    src = quantize.hf_source(str(src_folder))
    w = gguf.GGUFWriter(str(path), "llama")
    quantize.write_metadata(w, src, 0)
    for hf, shape in src.shapes.items():
        x = src.read(hf).float()
        if "q_proj" in hf or "k_proj" in hf:
            x = quantize.permute_qk(x, src.cfg.num_heads if "q_proj" in hf else src.cfg.num_kv_heads)
        name = quantize.gguf_name(hf)
        w.add_tensor(name, edit(name, x).contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("edit, message", [
    (lambda n, x: x.t() if n == "blk.1.ffn_down.weight" else x,
     "tensor blk.1.ffn_down.weight has shape [128, 64]; the config needs [64, 128]"),
    (lambda n, x: x * float("nan") if n == "blk.0.attn_norm.weight" else x, "tensor blk.0.attn_norm.weight holds NaN"),
])
def test_a_gguf_source_is_checked_by_its_own_names(edit, message, src, tmp_path, capsys):
    path = tmp_path / "src.gguf"
    write_float_gguf(src, path, edit)
    err = error([path, tmp_path / "out" / "x.gguf", "--type", "Q8_0"], capsys)
    assert f"{path}: {message}" in err
    assert os.listdir(tmp_path / "out") == []


def test_out_and_device_are_checked_before_the_source_is_read(src, tmp_path, capsys):
    out = tmp_path / "out"
    assert "OUT is an empty path" in error([src, "", "--type", "Q8_0"], capsys)
    assert f"{out}: is a folder" in error([src, out, "--type", "Q8_0", "--force"], capsys)
    assert f"no folder {tmp_path / 'nope'}" in error([src, tmp_path / "nope" / "x.gguf", "--type", "Q8_0"], capsys)
    assert "--device 'banana' is not a device" in error([src, out / "x.gguf", "--type", "Q8_0", "--device", "banana"],
                                                        capsys)
    assert os.listdir(out) == []


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     OSError("69632 requested and 33728 written")])  # numpy's tofile: no errno
def test_a_full_disk_is_one_line_naming_out(failure, src, tmp_path, capsys, monkeypatch):
    def write(self, tensor):
        raise failure
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    out = tmp_path / "out" / "x.gguf"
    err = error([src, out, "--type", "Q8_0"], capsys)
    assert err == f"minfer: error: {out}: cannot write (no space left on the device)"
    assert os.listdir(tmp_path / "out") == []


def test_force_never_overwrites_the_source(src, tmp_path, capsys):
    gguf_src = tmp_path / "src.gguf"
    write_float_gguf(src, gguf_src, lambda n, x: x)
    before = gguf_src.read_bytes()
    assert "is the source" in error([gguf_src, gguf_src, "--type", "Q8_0", "--force"], capsys)
    assert gguf_src.read_bytes() == before
    weights = src / "model.safetensors"
    before = weights.read_bytes()
    assert f"{weights}: is a file of the source {src}" in error([src, weights, "--type", "Q8_0", "--force"], capsys)
    assert weights.read_bytes() == before
    quantize_cli([src, src / "model.Q8_0.gguf", "--type", "Q8_0"])  # a new file beside the source's is fine


def test_out_is_written_under_a_name_of_its_own(src, tmp_path):
    """Another run's OUT.part is left alone; OUT gets the mode of a newly created file."""
    out = tmp_path / "out" / "x.gguf"
    other = tmp_path / "out" / "x.gguf.part"
    other.write_bytes(b"another run")
    quantize_cli([src, out, "--type", "Q8_0"])
    assert other.read_bytes() == b"another run" and sorted(os.listdir(tmp_path / "out")) == ["x.gguf", "x.gguf.part"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    assert gguf.GGUFReader(str(out)).tensors


def test_sigterm_removes_the_partial_file(tmp_path):
    out = tmp_path / "x.gguf"
    p = subprocess.Popen([sys.executable, "-m", "minfer.quantize", "--shape", "smollm2-135m", str(out), "--type",
                          "Q4_K_M"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(f.endswith(".part") for f in os.listdir(tmp_path)):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 143
    finally:
        p.kill()
    assert os.listdir(tmp_path) == [] and "Traceback" not in p.stderr.read()


def test_run_cli_turns_sigterm_into_143_and_restores_the_handler():
    def outside(signum, frame):  # the test's own handler: pytest lives on whatever run_cli does
        raise RuntimeError("SIGTERM outside run_cli's handling")
    pytest_handler = signal.signal(signal.SIGTERM, outside)
    try:
        assert run_cli(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))) == 143
        assert signal.getsignal(signal.SIGTERM) is outside
    finally:
        signal.signal(signal.SIGTERM, pytest_handler)
