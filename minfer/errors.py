"""User-facing errors: the CLI prints these as one line and exits non-zero. The user's files are opened
through `open_input`/`read_json`, so that a missing, unreadable or broken file names itself."""
from __future__ import annotations

import json


class MinferError(Exception):
    """A problem with the user's input (checkpoint, prompt, options), not a bug in minfer."""


def file_error(path: str, e: OSError) -> MinferError:
    if isinstance(e, FileNotFoundError):
        return MinferError(f"{path}: no such file")
    if isinstance(e, PermissionError):
        return MinferError(f"{path}: permission denied")
    return MinferError(f"{path}: cannot open ({e.strerror or type(e).__name__})")


def open_input(path: str, mode: str = "r"):
    """open() for the user's files (text as UTF-8): an OS error becomes a MinferError naming the path."""
    try:
        return open(path, mode) if "b" in mode else open(path, mode, encoding="utf-8")
    except OSError as e:
        raise file_error(path, e) from None


def check_readable(path: str) -> None:
    """For files that a library opens itself (safetensors, tokenizers): fail here, naming the path."""
    open_input(path, "rb").close()


def read_json(path: str, missing_ok: bool = False) -> dict | None:
    """The JSON object in `path`; None when the file does not exist and missing_ok."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError as e:
        if missing_ok:
            return None
        raise file_error(path, e) from None
    except OSError as e:
        raise file_error(path, e) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MinferError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise MinferError(f"{path}: holds a JSON {type(obj).__name__}, not an object")
    return obj
