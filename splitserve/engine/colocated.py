"""The colocated role: one worker does prefill and decode, the engine alone.

A request that came with a deadline (``GenerateRequest.deadline_s``: its sender's
``X-Splitserve-Deadline-S``) ends at it as a disaggregated room does: its key in a
:class:`~splitserve.engine.deadline_heap.DeadlineHeap`, checked at every ``tick``, the loop woken
for it (``wait_s``), and ended 504 ``request_timeout`` (``deadline_heap.request_timeout``) through
the engine's abort, which frees its pages."""

from __future__ import annotations

import logging
import time
from typing import Optional

from splitserve.engine.deadline_heap import DeadlineHeap, request_timeout
from splitserve.engine.engine import StepReport
from splitserve.engine.io import EngineError, GenerateRequest, RequestOutput
from splitserve.engine.role import IDLE_WAIT_S, EngineLoop
from splitserve.outcomes import Ending, Reason
from splitserve.timeline import TimelineBook

log = logging.getLogger(__name__)


class ColocatedRole:
    """One worker does prefill and decode: the engine's own outputs are the answers. Its
    timelines (``/debug/requests/{rid}``) come from the step reports: ``WAITING`` (arrived, or
    preempted), ``RUNNING`` (admitted: its prompt runs), ``DECODING`` (its first token), the end."""

    name = "colocated"

    def __init__(self):
        self.timelines = TimelineBook(self.name)
        self.deadlines: DeadlineHeap[str] = DeadlineHeap()  # rid -> when its sender's deadline passes
        self._limit_s: dict[str, float] = {}  # rid -> the deadline it came with (for its ending)
        self.clock = time.monotonic  # the loop's, from ``start``: the one its ``tick`` passes

    def start(self, loop: EngineLoop) -> None:
        self.engine = loop.engine
        self.clock = loop.clock

    def check(self, req: GenerateRequest) -> None:
        self.engine.check_fits(req)  # reads only immutable sizes

    def admit(self, req: GenerateRequest) -> list[RequestOutput]:
        now = self.clock()
        self.timelines.start(req.rid, None, "WAITING", now)
        try:
            self.engine.add_request(req)
        except EngineError as exc:
            return self._ended([RequestOutput.ended(req.rid, Ending(exc.reason, str(exc)))], "refused")
        if req.deadline_s is not None:
            self.deadlines.set(req.rid, now + req.deadline_s)
            self._limit_s[req.rid] = req.deadline_s
        return []

    def abort(self, rid: str, ending: Ending) -> list[RequestOutput]:
        out = self.engine.abort(rid, ending)
        return self._ended([out], "AbortRequest") if out is not None else []

    def abort_request(self, rid: Optional[str], room: Optional[int], kv_lost: bool,
                      detail: str) -> tuple[bool, list[RequestOutput]]:
        """``POST /abort_request`` (a colocated worker has no rooms, and no KV to lose)."""
        if rid is None or self.engine.sequence(rid) is None:
            return False, []
        log.info("request %s aborted: %s", rid, detail)  # its client reads only that it was aborted
        return True, self.abort(rid, Ending(Reason.CLIENT_ABORT, detail))

    def on_event(self, event: object) -> list[RequestOutput]:
        raise TypeError(f"unknown engine event {event!r}")

    def tick(self, now: float) -> list[RequestOutput]:
        """Every request whose deadline passed ends ``request_timeout``, its pages freed."""
        out: list[RequestOutput] = []
        for rid in self.deadlines.pop_due(now):
            ended = self.engine.abort(rid, request_timeout(self._limit_s.pop(rid)))
            out += [ended] if ended is not None else []
        return self._ended(out, "deadline")

    def after_step(self, report: StepReport) -> list[RequestOutput]:
        now, book = time.monotonic(), self.timelines
        for seq in report.admitted:
            if (tl := book.get(seq.rid)) is not None and tl.enter("RUNNING", now, "admitted"):
                book.started_work(tl, now)
        for seq in report.preempted:
            if (tl := book.get(seq.rid)) is not None:
                tl.enter("WAITING", now, "preempted")
        for seq, out in report.sampled:
            if seq.num_output_tokens == 1 and not out.finished and (tl := book.get(seq.rid)) is not None:
                tl.enter("DECODING", now, "first token")
        return self._ended(report.outputs, "step")

    def fail_all(self, ending: Ending) -> list[RequestOutput]:
        return self._ended(self.engine.abort_all(ending), "fail_all")

    def fail_request(self, rid: str, ending: Ending) -> list[RequestOutput]:
        """``rid``'s admission raised: end it (it may or may not be in the engine yet)."""
        out = self.engine.abort(rid, ending) or RequestOutput.ended(rid, ending)
        return self._ended([out], "fail_request")

    def _ended(self, outputs: list[RequestOutput], cause: str) -> list[RequestOutput]:
        now = time.monotonic()
        for out in outputs:
            if out.finished:  # ended by any path: its deadline goes with it
                self.deadlines.cancel(out.rid)
                self._limit_s.pop(out.rid, None)
            if out.finished and (tl := self.timelines.get(out.rid)) is not None and tl.live:
                reason = out.reason
                tl.end(f"FINISHED({out.finish_reason})" if reason is None else
                       f"{reason.outcome.value}({reason.value})", now, cause)
                self.timelines.ended(tl)
        return outputs

    def wait_s(self, now: float) -> float:
        due = self.deadlines.next_due()
        return max(0.001, min(IDLE_WAIT_S, due - now)) if due is not None else IDLE_WAIT_S

    def stats(self) -> None:
        return None  # the engine's counts are all a colocated worker has

    def debug_rows(self, now: float) -> list[dict]:
        return [{"rid": seq.rid, "room": None, "role": "colocated", "state": seq.status.value.upper(),
                 "age_s": round(now - seq.arrival, 3), "state_age_s": None, "deadline_s": self._left_s(seq, now),
                 "late": False, "peer": None} for seq in self.engine.live_sequences()]

    def _left_s(self, seq, now: float) -> Optional[float]:
        """Seconds left before ``seq``'s request reaches its deadline, None without one."""
        when = self.deadlines.when(seq.out_rid)
        return round(when - now, 3) if when is not None else None

    def close(self, goodbye: Optional[str] = None) -> None:
        pass
