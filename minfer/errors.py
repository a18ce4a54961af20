"""User-facing errors: the CLI prints these as one line and exits non-zero. The user's files are opened
through `open_input`/`read_json`, so that a missing, unreadable or broken file names itself."""
from __future__ import annotations

import argparse
import errno
import json
import re
import signal
import sys
import threading


class MinferError(ValueError):
    """A problem with the user's input (checkpoint, prompt, options), not a bug in minfer (a ValueError, so that
    `except ValueError` catches a bad argument as it does in other libraries)."""


def file_error(path: str, e: OSError, action: str = "open") -> MinferError:
    """e as one line naming path; action: what failed (open, write)."""
    if isinstance(e, FileNotFoundError):
        return MinferError(f"{path}: no such file")
    if isinstance(e, PermissionError):
        return MinferError(f"{path}: permission denied")
    if e.errno == errno.ENOSPC:
        return MinferError(f"{path}: cannot {action} (no space left on the device)")
    return MinferError(f"{path}: cannot {action} ({e.strerror or str(e) or type(e).__name__})")


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


class _Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that cleanup (finally, except BaseException) runs."""


def _terminate(signum, frame):
    raise _Terminated


def run_cli(fn) -> int:
    """Runs a command-line entry point: a MinferError is one line and exit 1; Ctrl-C ends quietly with 130, and
    SIGTERM (kill, timeout, a container stopping) with 143, each after the cleanup that removes partial files;
    stdout closed early (`| head`) ends quietly with 141, as a tool killed by SIGPIPE; anything else is one line
    naming the exception (MINFER_DEBUG=1 raises it, with its traceback)."""
    import os
    import sys

    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    old = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        fn()
    except MinferError as e:
        print(f"minfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return 143
    except BrokenPipeError:
        # Point stdout at /dev/null, so that the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        if os.environ.get("MINFER_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"minfer: error: {type(e).__name__}: {msg} (MINFER_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return 0


class ArgumentParser(argparse.ArgumentParser):
    """argparse under the CLI's rule: a bad flag is one line on stderr and exit 1 (argparse prints its usage and
    exits 2), and -inf / -nan are values, not flags, so that the value's own check names the flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+|\d*\.\d+|inf|infinity|nan)$", re.IGNORECASE)

    def error(self, message):
        print(f"minfer: error: {message} (--help for the options)", file=sys.stderr)
        raise SystemExit(1)
