"""Parsers of a model's own tool-call format, for tool_choice 'auto' (`--enable-auto-tool-choice --tool-call-parser
NAME`, vLLM's flags): the calls the model wrote are taken out of its text and returned as tool_calls."""
from __future__ import annotations

import json
import re


class Hermes:
    """Hermes' format, which Qwen2.5, Qwen3 and the Hermes models write: each call a JSON object {"name", "arguments"}
    between <tool_call> and </tool_call>; the text before the first call is the message's content."""
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
        """(content, [(name, arguments as JSON text)]), or None where the text holds no call that parses (it is then
        content as it is). A last call cut off before its </tool_call> counts where its JSON is whole."""
        at = text.find(self.START)
        if at < 0:
            return None
        calls = []
        for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[at:], re.S):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
            except (ValueError, KeyError, TypeError):
                return None
            if not isinstance(name, str):
                return None
            calls.append((name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))
        return text[:at] if text[:at].strip() else None, calls

    def held(self, text: str) -> int:
        """How many of the text's last characters may begin a call (a stream holds them back until it knows)."""
        return next((k for k in range(min(len(self.START) - 1, len(text)), 0, -1) if self.START.startswith(text[-k:])), 0)

    def content_end(self, text: str) -> tuple[int, bool]:
        """Where the content a stream may show ends in the text so far, and whether a call has begun there."""
        at = text.find(self.START)
        return (at, True) if at >= 0 else (len(text) - self.held(text), False)


PARSERS = {"hermes": Hermes}
