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
