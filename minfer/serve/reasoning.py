"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's flag): a thinking model's reasoning, written between <think>
and </think>, comes back apart from its answer, as the message's `reasoning_content` (DeepSeek's API and llama.cpp's
field). Only the answer goes on to the tool-call parser."""
from __future__ import annotations

START, END = "<think>", "</think>"


class Think:
    """An output's reasoning and answer: <think>reasoning</think>answer, the start tag optional. Where an output
    does not open with <think>, `in_reasoning` tells what its first text is: reasoning up to </think> (all of it
    without one), or the answer."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.phase, self.held = "open", ""  # open (the output may yet open <think>), reasoning or answer

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; None for a part that is not there."""
        reasoning, answer = self.feed(text, True)
        return reasoning or None, answer or None

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the answer that text adds to the output so far. A tail that may begin a tag is held
        back until the next text tells, or the end."""
        held, reasoning, answer = self.held + text, "", ""
        while held:
            if self.phase == "open":
                if held.startswith(START):
                    held, self.phase = held[len(START):], "reasoning"
                elif START.startswith(held) and not finished:
                    break
                else:
                    self.phase = "reasoning" if self.in_reasoning else "answer"
            elif self.phase == "reasoning":
                at = held.find(END)
                if at >= 0:
                    reasoning += held[:at]
                    held, self.phase = held[at + len(END):], "answer"
                    continue
                keep = 0 if finished else _tag_prefix(held, END)
                reasoning, held = reasoning + held[:len(held) - keep], held[len(held) - keep:]
                break
            else:
                answer, held = answer + held, ""
        self.held = held
        return reasoning, answer


def _tag_prefix(text: str, tag: str) -> int:
    """How many of the text's last characters begin the tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


# A parser's name -> whether an output that does not open <think> begins in the reasoning, given the prompt's text.
# DeepSeek-R1's template ends the prompt inside the reasoning; Qwen3's output opens the tag itself (without it, as
# with enable_thinking=False, the text is the answer), unless the prompt ends with <think> (its thinking-only models).
PARSERS = {
    "deepseek_r1": lambda prompt: True,
    "qwen3": lambda prompt: prompt.rstrip().endswith(START),
}


def parser(name: str, prompt: str) -> Think:
    return Think(PARSERS[name](prompt))
