"""The engine loop: one thread owns the EngineCore and steps it back to back while requests run.

The asyncio side never touches the core. It puts commands (add, abort) on a thread-safe queue, and the thread
applies them between steps, so an abort frees the request's pages before the next forward pass. A step's
outputs reach each event loop in one hand-off (one call_soon_threadsafe a step, not one a token: each is a
write to the loop's wake-up socket, which also hands the GIL over), and the thread never waits on a loop.
Metrics are fed once a step. An exception in a step fails the requests of that step, not the loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine.core import EngineCore, RequestOutput
from ..sampling import SamplingParams
from .metrics import Metrics

log = logging.getLogger("minfer.serve")


@dataclass(slots=True)
class Delta:
    """What one step added to one request (one choice of an HTTP request)."""
    index: int  # the choice
    token_ids: list[int]  # new output ids
    logprobs: list[dict] | None  # one entry per new id, when asked for
    text: str  # new text (text that may still begin a stop string is held back)
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int  # output ids so far
    cached_tokens: int
    prompt_logprobs: list | None = None  # the request's, on its first delta, when asked for


class Outputs:
    """One HTTP request's deltas (all its choices), filled on its event loop. get() takes everything that came
    since the last get, so that deltas which piled up while the loop was busy are handled together."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self._items: list = []  # Delta, or an Exception that ends the request
        self._ready: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    async def get(self) -> list:
        while not self._items:
            self._ready = self.loop.create_future()
            await self._ready
        items, self._items = self._items, []
        return items


def _put_all(items: list[tuple[Outputs, object]]) -> None:
    for out, item in items:
        out.put(item)


@dataclass(eq=False)
class _Request:
    """The thread's state of one engine request."""
    out: Outputs
    index: int
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float = 0.0
    sent: int = 0  # output ids handed out so far
    started: bool = False  # a delta handed out


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        self.metrics = Metrics(self)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # adds not applied yet count as waiting: submitted - applied, each written by one thread only; the thread
        # moves a batch into the scheduler's queue and counts it applied under _counting, so that num_waiting never
        # sees it in neither place (nor in both)
        self._submitted = self._applied = 0
        self._counting = threading.Lock()
        self._requests: dict[str, _Request] = {}  # owned by the thread
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="minfer-engine", daemon=True)
        self._thread.start()

    # ---- the asyncio side ----

    @property
    def num_waiting(self) -> int:
        with self._counting:
            return len(self.core.scheduler.waiting) + self._submitted - self._applied

    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, requests: list[tuple[str, list[int], SamplingParams, int]], out: Outputs,
            priority: int = 0) -> asyncio.Future:
        """Queues the engine requests of one API request, (id, prompt ids, params, choice index) each, all or none:
        the future resolves once the core took them all, or raises the MinferError of the first bad one (then none
        was added, so none is prefilled or counted). They count in num_waiting at once (no await between a
        caller's check of the count and the add). Cancelling the future before the core took them drops them.
        priority: theirs (--scheduling-policy priority; lower first)."""
        done = concurrent.futures.Future()
        self._submitted += len(requests)
        self._commands.put(("add", requests, out, done, priority))
        self._wake.set()
        return asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Ends the request at the next step and frees its pages; nothing if it has finished."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the thread ----

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.core.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self._deliver(self.core.step())
            except Exception as e:  # a bug, not a bad request: fail what was running, keep serving
                log.exception("engine step failed; aborting its requests")
                for rid in list(self._requests):
                    self._abort(rid, e)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort":
                self._abort(cmd[1])
                continue
            _, requests, out, done, priority = cmd
            with self._counting:
                self._applied += len(requests)
                if not done.set_running_or_notify_cancel():  # the client left before they were added
                    continue
                try:
                    self.core.add_requests([(ids, params, rid) for rid, ids, params, _ in requests],
                                           [priority] * len(requests))
                except Exception as e:
                    done.set_exception(e)
                    continue
            for rid, ids, _, index in requests:
                self._requests[rid] = _Request(out, index, len(ids))
                self.metrics.prompt_tokens.inc(len(ids))
            done.set_result(None)

    def _abort(self, rid: str, error: Exception | None = None) -> None:
        self.core.abort_request(rid)
        req = self._requests.pop(rid, None)
        if req is None:
            return
        reason = "abort" if error is None else "error"
        self.metrics.finished.labels(reason).inc()
        self._log(rid, req, reason)
        if error is not None:
            self._hand_over(req.out.loop, [(req.out, error)])

    def _deliver(self, outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        m = self.metrics
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        tokens, gaps = 0, {}  # gap since a request's last token -> requests: most share the step's own gap
        try:
            for o in outs:
                req = self._requests.get(o.request_id)
                if req is None:
                    continue
                n = len(o.token_ids)
                new_ids = o.token_ids[req.sent:]
                logprobs = o.logprobs[req.sent:n] if o.logprobs is not None else None
                req.sent = n
                if new_ids:
                    tokens += len(new_ids)
                    if req.first is None:
                        req.first = now
                        m.ttft.observe(now - req.arrival)
                    else:
                        gap = now - req.last
                        gaps[gap] = gaps.get(gap, 0) + 1
                    req.last = now
                batches.setdefault(req.out.loop, []).append((req.out, Delta(
                    req.index, new_ids, logprobs, o.new_text, o.finished, o.finish_reason, req.prompt_tokens, n,
                    o.num_cached_tokens, None if req.started else o.prompt_logprobs)))
                req.started = True
                if o.finished:
                    del self._requests[o.request_id]
                    m.e2e.observe(now - req.arrival)
                    m.finished.labels(o.finish_reason).inc()
                    self._log(o.request_id, req, o.finish_reason)
        finally:  # a failure midway still hands over the deltas built: the aborts that follow skip finished ones
            for loop, items in batches.items():
                self._hand_over(loop, items)
        m.generation_tokens.inc(tokens)
        for gap, count in gaps.items():
            m.itl.observe(gap, count)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening
            for rid in [rid for rid, req in self._requests.items() if req.out.loop is loop]:
                self._abort(rid)

    def _log(self, rid: str, req: _Request, reason: str | None) -> None:
        now = time.perf_counter()
        ttft = f"{(req.first - req.arrival) * 1e3:.1f} ms" if req.first else "-"
        log.info("request %s: prompt %d tokens, completion %d tokens, ttft %s, total %.1f ms, finish %s", rid,
                 req.prompt_tokens, req.sent, ttft, (now - req.arrival) * 1e3, reason)
