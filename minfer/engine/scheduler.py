"""Which sequences run in the next step, and how many of their tokens. One step is one forward pass.

Each sequence has tokens (prompt + output) and a count of those already in the KV cache; a step computes
some of the rest. A decode is the case of one token left; a prompt is prefilled in chunks. The order of
a step:
1. running sequences with one token left (decodes): every one, every step;
2. running sequences part-way through their prompt: the next chunk, as the token budget
   (max_num_batched_tokens) allows, so that a long prompt never stalls the decodes;
3. waiting sequences, oldest first, while pages, the budget and max_num_seqs last; their cached prefix
   (block manager) is skipped.
In a step with decodes, a prompt's chunk is at most long_prefill_token_threshold tokens (0: no cap): the
decodes' inter-token latency then stays near a decode step's while a long prompt prefills, and a step of
prompts alone still takes the whole budget. A prompt whose logprobs are asked for skips the prefix cache; such
prompts run at most PROMPT_LOGPROBS_CHUNK tokens a step together, each token's logits kept.
When a running sequence needs a page and none is left (in either pool, with sliding-window layers), the
newest running sequence is preempted: its pages are freed, it goes back to the head of the queue, and its
tokens (prompt and output so far) are computed again when it is readmitted. Nothing it generated is lost.
With the priority policy (vLLM's --scheduling-policy priority) the queue is in (priority, arrival) order, lower
first, and the victim is the running sequence last in that order.
With async scheduling a sequence's last sampled token may still be on its way to the host (in flight): it
counts as one of its tokens, and a sequence whose in-flight token is its last (max_tokens) is not scheduled.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from ..errors import MinferError
from .block_manager import BlockManager
from .sequence import Sequence, Status


# The most prompt tokens a step whose logprobs are asked for, all such prompts together: each keeps its row of
# logits ([tokens, vocab] fp32: 268 MB at Gemma 3's 262k tokens).
PROMPT_LOGPROBS_CHUNK = 256
POLICIES = ("fcfs", "priority")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each sequence this step

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, policy: str = "fcfs"):
        self.policy, self._arrivals = policy, itertools.count()
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is last
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # rows of the decode graphs' page table
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        bm, n = self.bm, len(seq.prompt_ids) + seq.max_tokens
        if bm.pages_for(n) > bm.num_pages:
            raise MinferError(f"a request of {len(seq.prompt_ids)} prompt tokens and {seq.max_tokens} new ones needs "
                              f"more than the {bm.num_pages} pages of {bm.page_size} tokens in the KV cache "
                              f"(raise --num-pages or --gpu-memory-utilization, or lower max tokens)")
        if bm.window is not None and bm.local_pages_for(n, self.max_num_batched_tokens) > bm.num_local_pages:
            raise MinferError(f"a request of {n} tokens needs more than the {bm.num_local_pages} pages of "
                              f"{bm.page_size} tokens of the sliding-window layers' KV cache (raise "
                              f"--gpu-memory-utilization, or lower --max-num-batched-tokens)")
        seq.order = next(self._arrivals)
        self._queue(seq)

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Into the waiting queue: last (fcfs; a preempted sequence first), or at its (priority, arrival) place."""
        if self.policy == "priority":
            bisect.insort(self.waiting, seq, key=_rank)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest (fcfs), or the last in (priority, arrival) order."""
        return self.running[-1] if self.policy == "fcfs" else max(self.running, key=_rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (done or aborted), wherever it is, and frees its pages."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.bm.free_pages(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _release_slot(self, seq: Sequence) -> None:
        self.free_slots.append(seq.slot)
        seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_slot(seq)
        self.bm.free_pages(seq)
        seq.status = Status.WAITING
        self._queue(seq, front=True)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}  # insertion-ordered: the batch's order
        preempted = False
        decodes, prefills = [], []  # (sequence, tokens left to compute)
        for s in self.running:
            left = s.num_tokens - s.num_computed_tokens
            if left > 1:
                prefills.append((s, left))
            elif s.num_computed_tokens < len(s.prompt_ids) or s.num_output_tokens + s.in_flight < s.max_tokens:
                # a prompt's last token (one scored alone, max_tokens 0, samples nothing after it), or a decode
                # whose last token is not in flight
                decodes.append((s, 1))
        # the most tokens of one prompt this step
        chunk = self.long_prefill_token_threshold if decodes and self.long_prefill_token_threshold else budget
        kept = PROMPT_LOGPROBS_CHUNK  # prompt tokens whose logits this step may still keep
        for seq, left in decodes + prefills:
            if seq.status != Status.RUNNING or budget == 0:  # preempted earlier in this loop, or out of budget
                continue
            n = min(left, budget, chunk, kept if seq.wants_prompt_logprobs else left)
            if n == 0:
                continue
            kept -= n if seq.wants_prompt_logprobs else 0
            while not self.bm.allocate(seq, n):
                victim = self._victim()
                budget += chosen.pop(victim, 0)  # a victim scheduled earlier in this step is taken back
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chosen[seq] = n
                budget -= n
        # No admissions in a step that preempted: the pool is full, a new sequence would only be preempted.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.in_flight:  # preempted with a token in flight: admitted once it is read
                break
            cached = [] if seq.wants_prompt_logprobs else self.bm.lookup(seq)  # a cached token has no logits
            n = min(seq.num_tokens - len(cached) * self.bm.page_size, budget, chunk)
            if seq.wants_prompt_logprobs:
                n = min(n, kept)
            if n == 0 or not self.bm.allocate(seq, n, cached):
                break
            kept -= n if seq.wants_prompt_logprobs else 0
            self.waiting.popleft()
            seq.status, seq.slot = Status.RUNNING, self.free_slots.pop()
            self.running.append(seq)
            chosen[seq] = n
            budget -= n
        if not chosen and self.has_unfinished() and not any(s.in_flight for s in self.running + list(self.waiting)):
            # Unreachable while add() keeps each request within the pool; a loud error beats a silent hang.
            raise MinferError("the scheduler could not run any sequence (KV cache too small)")
        return ScheduledBatch(list(chosen), list(chosen.values()))


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.order
