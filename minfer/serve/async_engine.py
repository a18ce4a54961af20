"""The engine loop: one thread owns the EngineCore and steps it while requests run.

The asyncio side never touches the core. It puts commands (add, abort) on a thread-safe queue, and gets each
request's tokens through an asyncio.Queue that the thread fills with call_soon_threadsafe. Commands are
applied between steps, so an abort frees the request's pages before the next forward pass. An exception in
a step fails the requests of that step, not the loop.
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


@dataclass
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


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of Delta, or an Exception that ends the request
    index: int
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float = 0.0
    sent: int = 0  # output ids handed out so far

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        self.metrics = Metrics(self)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # adds not applied yet count as waiting: submitted - applied, each written by one thread only
        self._submitted = self._applied = 0
        self._streams: dict[str, _Stream] = {}  # owned by the thread
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="minfer-engine", daemon=True)
        self._thread.start()

    # ---- the asyncio side ----

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting) + self._submitted - self._applied

    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, out: asyncio.Queue,
                  index: int = 0) -> None:
        """Queues the request; returns once the core took it, or raises its MinferError (a bad prompt)."""
        done = concurrent.futures.Future()
        stream = _Stream(asyncio.get_running_loop(), out, index, len(prompt_ids))
        self._submitted += 1
        self._commands.put(("add", request_id, prompt_ids, params, stream, done))
        self._wake.set()
        await asyncio.wrap_future(done)

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
                outs = self.core.step()
                now = time.perf_counter()
                for o in outs:
                    self._deliver(o, now)
            except Exception as e:  # a bug, not a bad request: fail what was running, keep serving
                log.exception("engine step failed; aborting its requests")
                for rid in list(self._streams):
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
            _, rid, ids, params, stream, done = cmd
            self._applied += 1
            if not done.set_running_or_notify_cancel():  # the client left before it was added
                continue
            try:
                self.core.add_request(ids, params, rid)
            except Exception as e:
                done.set_exception(e)
                continue
            self._streams[rid] = stream
            self.metrics.prompt_tokens.inc(len(ids))
            done.set_result(None)

    def _abort(self, rid: str, error: Exception | None = None) -> None:
        self.core.abort_request(rid)
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        reason = "abort" if error is None else "error"
        self.metrics.finished.labels(reason).inc()
        self._log(rid, stream, reason)
        if error is not None:
            stream.put(error)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        n = len(out.token_ids)
        new_ids = out.token_ids[stream.sent:]
        logprobs = out.logprobs[stream.sent:n] if out.logprobs is not None else None
        stream.sent = n
        m = self.metrics
        if new_ids:
            m.generation_tokens.inc(len(new_ids))
            if stream.first is None:
                stream.first = now
                m.ttft.observe(now - stream.arrival)
            else:
                m.itl.observe(now - stream.last)
            stream.last = now
        if out.finished:
            del self._streams[out.request_id]
            m.e2e.observe(now - stream.arrival)
            m.finished.labels(out.finish_reason).inc()
            self._log(out.request_id, stream, out.finish_reason)
        try:
            stream.put(Delta(stream.index, new_ids, logprobs, out.new_text, out.finished, out.finish_reason,
                             stream.prompt_tokens, n, out.num_cached_tokens))
        except RuntimeError:  # its event loop is closed: nobody is listening
            self._abort(out.request_id)

    def _log(self, rid: str, stream: _Stream, reason: str | None) -> None:
        now = time.perf_counter()
        ttft = f"{(stream.first - stream.arrival) * 1e3:.1f} ms" if stream.first else "-"
        log.info("request %s: prompt %d tokens, completion %d tokens, ttft %s, total %.1f ms, finish %s", rid,
                 stream.prompt_tokens, stream.sent, ttft, (now - stream.arrival) * 1e3, reason)
