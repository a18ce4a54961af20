"""The CLI's conversation mode (`python -m minfer.generate -cnv`, llama-cli's): a chat at the terminal. Each turn
renders the whole history with the model's chat template; the prefix cache keeps the earlier turns' pages, so a
turn computes little more than its own message."""
from __future__ import annotations

import signal
import sys

from .errors import MinferError
from .generate import MAX_PROMPT_BYTES

HELP = "/exit or Ctrl-D ends, /clear starts over, a line ending in \\ continues on the next; Ctrl-C stops a reply"


class Conversation:
    """The messages so far and one reply at a time. stop_requested: set (by Ctrl-C) while a reply streams, it
    ends that reply after the step in flight, and what was shown of it stays in the history."""

    def __init__(self, llm, params, system: str | None = None):
        self.llm, self.params, self.system = llm, params, system
        self.messages: list[dict] = []
        self.stop_requested = False
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, write) -> tuple[str, str | None]:
        """Adds the user's message, streams the reply through write(delta) and adds it. Returns (the reply, its
        finish reason: "stop", "length" (max_tokens), "context" (cut at the context's end) or None (stopped)). A
        turn the context cannot hold raises MinferError with the history as it was."""
        turn = self.messages + [{"role": "user", "content": text}]
        shown: list[str] = []
        self.stop_requested = False

        def on_output(_, out):
            if out.new_text:
                shown.append(out.new_text)
                write(out.new_text)
            if self.stop_requested and not out.finished:
                raise _Stopped  # between steps: generate() aborts the request and frees its pages

        try:
            (out,) = self.llm.chat(turn, self.params, on_output=on_output, use_tqdm=False)
            reply, reason = out.text, out.finish_reason
            if reason == "length" and len(out.token_ids) < self.params.max_tokens:
                reason = "context"
        except _Stopped:
            reply, reason = "".join(shown), None
        if reply or reason is not None:
            self.messages = turn + [{"role": "assistant", "content": reply}]
        return reply, reason


class _Stopped(Exception):
    pass


def _read_message(prompt: str) -> str | None:
    """One message from stdin: lines joined while they end in a backslash. None at the end of input."""
    lines = []
    while True:
        line = _read_line(prompt if not lines else "... " if prompt else "")
        if line is None:
            return "\n".join(lines) if lines else None
        if not line.endswith("\\"):
            return "\n".join(lines + [line])
        lines.append(line[:-1])


def _read_line(prompt: str) -> str | None:
    if sys.stdin.isatty():
        try:
            return input(prompt)
        except EOFError:
            return None
        except UnicodeDecodeError:
            print("[minfer] that line is not valid UTF-8; type it again", file=sys.stderr)
            return ""
    data = sys.stdin.buffer.readline(MAX_PROMPT_BYTES + 1)
    if not data:
        return None
    if len(data) > MAX_PROMPT_BYTES:
        raise MinferError(f"a line of stdin holds over {MAX_PROMPT_BYTES >> 20} MiB, more than any context")
    text = data.decode("utf-8", "replace")
    if "\ufffd" in text and "\ufffd".encode() not in data:
        print("[minfer] stdin is not valid UTF-8; its undecodable bytes are replaced by U+FFFD", file=sys.stderr)
    return text.removesuffix("\n").removesuffix("\r")


def converse(llm, params, system: str | None, first: str | None, on_reply=None) -> None:
    """Reads messages from stdin until /exit or its end; each reply streams to stdout, then a newline.
    first: the first message (-p), sent before any is read. on_reply(): after each reply (the stats)."""
    conv = Conversation(llm, params, system)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"[minfer] conversation: {HELP}", file=sys.stderr)

    def stop_reply(*_):
        if conv.stop_requested:  # a second Ctrl-C (say, in a long prefill) ends the program
            raise KeyboardInterrupt
        conv.stop_requested = True

    while True:
        text = first if first is not None else _read_message("> " if interactive else "")
        first = None
        if text is None or text.strip() == "/exit":
            return
        if text.strip() == "/clear":
            conv.clear()
            continue
        if not text.strip():
            continue
        old = signal.signal(signal.SIGINT, stop_reply)
        try:
            _, reason = conv.reply(text, lambda delta: (sys.stdout.write(delta), sys.stdout.flush()))
        except MinferError as e:
            print(f"[minfer] {e}; /clear starts over", file=sys.stderr)
            continue
        finally:
            signal.signal(signal.SIGINT, old)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if reason == "context":
            print("[minfer] the reply reached the context's end; /clear starts over", file=sys.stderr)
        if on_reply is not None:
            on_reply()
