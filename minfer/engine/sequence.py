"""One request's state as the scheduler, the block manager and the runner see it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted: holds no pages
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity comparison: two requests with equal fields are still two requests
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, capped by what fits in the context after the prompt
    seed: int  # the sampler's key: params.seed, or one drawn when the request came in
    token_ids: list[int] = field(default_factory=list)  # prompt + output; filled by __post_init__
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K and V are in the cache
    num_cached_tokens: int = 0  # of those, taken from the prefix cache at the last admission
    # tokens sampled by launched steps whose ids are not read back yet (async scheduling: 0, 1 or 2); they
    # count in num_tokens, so that the scheduler plans the next step as if they were there
    in_flight: int = 0
    slot: int = -1  # a row of its own in the decode graphs' page table while it runs (the scheduler's)
    output_token_ids: list[int] = field(default_factory=list)  # token_ids past the prompt, kept as they come
    block_table: list[int] = field(default_factory=list)  # page ids, in position order
    # the sliding group's page ids, as block_table; its first num_local_freed entries are the scratch page
    local_block_table: list[int] = field(default_factory=list)
    num_local_freed: int = 0
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full pages so far
    num_registered_pages: int = 0  # pages offered to the prefix cache
    finish_reason: str | None = None  # length | stop | abort
    stop_ids: frozenset = frozenset()  # sampled ids that end it (the model's, unless ignore_eos, and its own)
    penalized: bool = False  # a repetition, presence or frequency penalty: sampling reads its ids on the host
    matcher: object = None  # structured outputs: its llguidance matcher, whose mask needs every id on the host
    reasoning_end: int | None = None  # the id that ends its reasoning, while in it: the matcher takes ids after it
    # front-end state: text decoded so far and how much of it was handed out; a request without stop strings
    # decodes only when an output's text is read (text_ends[i]: the text's length after output id i)
    text: str = ""
    emitted: int = 0
    decoder: object = None
    text_ends: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # entry k: prompt token k + 1's (params.prompt_logprobs)
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's rule), then the earlier arrival
    order: int = 0  # its place in arrival order (the scheduler's)

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.in_flight

    @property
    def output_ids(self) -> list[int]:
        return self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: its prompt runs without the prefix cache, in chunks
        whose logits are all kept."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def decoded_length(self, n: int, final: bool = False) -> int:
        """The length of the text of the first n output ids, decoding those not decoded yet; final (n is all of
        a finished request's ids): with the text the decoder held back for an unfinished character."""
        ends = self.text_ends
        while len(ends) < n:
            self.text += self.decoder.push(self.output_token_ids[len(ends)]) if self.decoder else ""
            ends.append(len(self.text))
        if final:
            self.text += self.decoder.flush() if self.decoder else ""
            return len(self.text)
        return ends[n - 1] if n else 0
