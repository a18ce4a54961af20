"""Structured outputs: a JSON schema, any JSON object, a regex, a choice of strings or a grammar (Lark, or llama.cpp's
GBNF) constrains each token a request samples. llguidance's matcher keeps each request's parse state on the host and
gives the next token's allowed ids as a bitmask, a step's rows computed on llguidance's threads; the masks go to the
device packed (32 ids a word) and the sampler sets the logits of the ids they leave out to -inf (the logprobs stay
those of the model's raw distribution, as the unconstrained ones). A step that decodes a constrained request
reads the step before's ids once its forward is queued, as for penalties: the mask needs the token sampled last."""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from .errors import MinferError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
PARALLEL_MASKS = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
CHEAP_BUILD_S = 0.02  # a constraint that builds within this gets its own matchers up to PARALLEL_MASKS
# Compact JSON ({"a":1,"b":[2]}, no whitespace): a model free to add whitespace may add it forever.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass
class StructuredOutputs:
    """vLLM's StructuredOutputsParams: exactly one of the fields."""
    json: dict | str | None = None  # a JSON schema (a dict, or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # Lark (llguidance's) or GBNF (llama.cpp's)

    def kind(self) -> str:
        # json=False is the schema false (given); json_object=False is json_object not asked for
        given = [k for k in KINDS if getattr(self, k) is not None and (k == "json" or getattr(self, k) is not False)]
        if len(given) != 1:
            raise MinferError(f"structured_outputs: give exactly one of {', '.join(KINDS)}, not "
                              f"{', '.join(given) if given else 'none'}")
        return given[0]

    def grammar_text(self) -> str:
        """llguidance's form of the constraint. Raises MinferError for input that is not one."""
        llg = _llguidance()
        kind = self.kind()
        try:
            if kind == "json":
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if schema is False:
                    raise ValueError("the schema false matches nothing")
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema is an object (or true)")
                return llg.LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=JSON_OPTIONS)
            if kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if kind == "regex":
                return llg.LLMatcher.grammar_from_regex(_text(self.regex, "regex"))
            if kind == "choice":
                if not (isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice)):
                    raise ValueError("a non-empty list of strings")
                return llg.grammar_from("choice", self.choice)
            return llg.grammar_from("grammar", _text(self.grammar, "grammar"))
        except (ValueError, TypeError) as e:
            raise MinferError(f"structured_outputs.{kind}: {_first_line(str(e))}") from None
        except RecursionError:
            raise MinferError(f"structured_outputs.{kind}: nested too deeply") from None


def renamed(error: MinferError, field: str) -> MinferError:
    """A constraint's error under the name of the field that gave it (a CLI flag, response_format)."""
    return MinferError(f"{field}: {str(error).split(': ', 1)[-1]}")


def _first_line(error: str) -> str:
    """llguidance's message in a line: its first, without the backtrace a panic appends or a pattern's drawing, but
    with the drawing's `error: ...` line where the first ends at a colon (a regex's syntax errors)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid"
    why = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {why}" if lines[0].endswith(":") and why else lines[0]


def _text(value, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} must be text, not {type(value).__name__}")
    return value


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise MinferError("structured outputs need the llguidance package: pip install llguidance") from None
    return llguidance


class Matchers:
    """The engine's side: its tokenizer in llguidance's form (built on first use, ~1 s for a large vocabulary),
    a matcher a constrained request, and the masks of a step's rows."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._ll = None
        self._executor = None  # llguidance's threads for a step's masks
        # a checked constraint (as JSON) -> its matchers, never advanced, and the fewest seconds one took to build:
        # a request takes a copy (a 20k-string choice builds in ~0.6 s and copies in ~1 ms, so the server's check
        # builds it off the engine's thread). Copies of one matcher share its caches behind one lock, so their masks
        # are computed one at a time: a constraint that builds fast gets up to PARALLEL_MASKS matchers, whose copies
        # compute apart (64 rows of a regex on 16 cores: 24 ms a step with one, 3.4 ms with 16).
        self._built: dict[str, tuple[list, float]] = {}
        self._handed = 0  # copies handed out, which deals them over a constraint's matchers
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        if self._ll is None:
            if self.tokenizer is None:
                raise MinferError("structured outputs need the model's tokenizer, and this model has none")
            llg = _llguidance()
            self._ll = llg.LLTokenizer(self.tokenizer.tok.to_str(), n_vocab=self.vocab_size,
                                       eos_token=list(self.stop_ids) or None)
        return self._ll

    def check(self, spec: StructuredOutputs) -> None:
        """A MinferError when spec is no constraint this tokenizer can follow (its matcher is built and kept)."""
        self._matchers(spec, grow=False)

    def matcher(self, spec: StructuredOutputs):
        """A new matcher for spec, checked: it builds, and some text satisfies it (its first mask is no error)."""
        built = self._matchers(spec, grow=True)
        with self._lock:
            self._handed += 1
            return built[self._handed % len(built)].deep_copy()

    def _matchers(self, spec: StructuredOutputs, grow: bool) -> list:
        """spec's matchers (_built): the first built, and with grow one more where it builds fast."""
        key = json.dumps(asdict(spec), sort_keys=True, default=str)
        built, seconds = self._built.get(key) or ([], 0.0)
        if not built or (grow and len(built) < PARALLEL_MASKS and seconds < CHEAP_BUILD_S):
            self._ll_tokenizer()  # built once, and not part of the constraint's time
            start = time.perf_counter()
            matcher = self._build(spec)
            seconds = time.perf_counter() - start
            with self._lock:  # the server checks on its event loop's threads, the engine on its own
                if key not in self._built and len(self._built) >= 64:  # requests may each bring another schema
                    self._built.pop(next(iter(self._built)), None)
                built, fastest = self._built.get(key) or ([], seconds)
                built.append(matcher)
                self._built[key] = (built, min(fastest, seconds))  # a first build also warms llguidance up
        return built

    def _build(self, spec: StructuredOutputs):
        llg = _llguidance()
        grammar = spec.grammar_text()
        error = llg.LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        if error and not error.startswith("WARNING"):
            raise MinferError(f"structured_outputs.{spec.kind()}: {_first_line(error)}")
        m = llg.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise MinferError(f"structured_outputs.{spec.kind()}: {_first_line(m.get_error())}")
        m.compute_bitmask()  # a constraint no text meets errs here: its mask would allow nothing
        if m.is_error():
            raise MinferError(f"structured_outputs.{spec.kind()}: no text satisfies it ({_first_line(m.get_error())})")
        return m

    def bitmask(self, matchers: list) -> np.ndarray:
        """[rows, ceil(vocab / 32)] int32: each row's next allowed ids, id 32 w + b as bit b of word w (every id where
        its matcher is None). The rows are computed on llguidance's threads, in parallel where they copy matchers built
        apart (matcher)."""
        import llguidance.numpy
        out = np.full((len(matchers), -(-self.vocab_size // 32)), -1, dtype=np.int32)
        rows = [(m, row) for row, m in enumerate(matchers) if m is not None]
        if not rows:
            return out
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, out)
        return out

