"""The prefill role: runs prompts and writes their KV into the decode worker's pages, chunk by
chunk (``docs/protocol.md``). Its table is a :class:`~splitserve.disagg.lifecycle.PrefillTable`.

From the engine's step report: a room admitted (``Scheduled``, its pages), a prompt chunk done
(``ChunkDone``: the full pages start a write), the whole prompt done (``ForwardDone``: the first
token), a forward pass that failed (``LocalFailure``). Its pages are its sequence's, allocated by
the scheduler at admission and freed by the table's ``FreePages`` once every write has settled.
"""

from __future__ import annotations

import functools

from splitserve.disagg import protocol as p
from splitserve.disagg.control import PrefillControl
from splitserve.disagg.control.prefill_server import SessionLimits, ZmqRouterEndpoint
from splitserve.disagg.lifecycle import (
    CancelWrites, ChunkDone, DisconnectPeer, Enqueue, ForwardDone, LocalFailure, Peer, PrefillTable, Reason, ResetTransfer,
    Scheduled, StartWrite, WriteFailed,
)
from splitserve.disagg.role import DisaggRole, RoomRecord
from splitserve.disagg.transfer.base import create_backend, page_spans
from splitserve.disagg.transfer.thread import Cancel as CancelTransfer
from splitserve.disagg.transfer.thread import Notify, ResetPeer, TransferWorker, Write
from splitserve.engine.engine import StepReport
from splitserve.engine.io import InvalidRequest, RequestOutput
from splitserve.engine.worker_stats import PrefillStats


class PrefillRole(DisaggRole):
    name = "prefill"
    prompt_only = True  # the generated tokens live on decode
    backend = None

    def _start(self) -> None:
        layout = self.engine.layout
        self.backend = create_backend(self.server.transfer_backend, f"prefill-{self.incarnation}",
                                      self.engine.kv.buffer, **self._transfer_opts())
        self.transfer = TransferWorker(self.backend, self.post, self.faults.transfer)
        self.table = PrefillTable(self.deadlines, self.incarnation, layout.page_size, layout.page_nbytes)
        self.control = PrefillControl(self.server.host, self.server.bootstrap_port, self.info, self.transfer,
                                      self.post, self.deadlines, self.faults.control,
                                      lambda: not self.loop.loop_stalled(),
                                      bind=self.seams.bind or functools.partial(ZmqRouterEndpoint, secret=self.secret),
                                      io_probe=self._io_probe(), wake=self.seams.control_wake,
                                      limits=SessionLimits(self.server.max_control_sessions,
                                                           self.server.max_control_sessions_per_address,
                                                           self.server.control_session_rate))

    def after_step(self, report: StepReport) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        page_size = self.engine.layout.page_size
        for seq in report.admitted:
            if (rec := self._record_of(seq)) is not None:
                out += self._handle_event(Scheduled(rec.room, tuple(seq.pages)))
        for seq in report.chunks:
            if (rec := self._record_of(seq)) is not None:
                out += self._handle_event(ChunkDone(rec.room, seq.num_computed // page_size))
        for seq in report.first_tokens:
            if (rec := self._record_of(seq)) is not None:
                lp = seq.first_logprob
                logprobs = lp.to_bytes() if lp is not None else b""
                out += self._handle_event(ForwardDone(rec.room, seq.token_ids[-1], logprobs))
        for seq, failed in report.failed:
            if (rec := self._record_of(seq)) is not None:
                out += self._handle_event(LocalFailure(rec.room, Reason.INTERNAL_ERROR, failed.error))
        return out

    kv_bytes_written = 0  # a counter: KV bytes handed to the transfer for decode workers

    def _own_stats(self) -> PrefillStats:
        return PrefillStats(kv_transfer_bytes=self.kv_bytes_written, sessions_refused=self.control.sessions_refused())

    def _do_role(self, a, out: list[RequestOutput]) -> None:
        match a:
            case Enqueue():
                rec = self.rooms[a.room]
                try:
                    rec.seq = self.engine.add_request(rec.req, prefill_only=True)
                except InvalidRequest as exc:
                    out += self._handle_event(LocalFailure(a.room, Reason.BAD_REQUEST, str(exc)))
            case StartWrite():
                self._start_write(a, out)
            case CancelWrites():
                self.transfer.submit(CancelTransfer(a.write_ids))
            case ResetTransfer():
                self.transfer.submit(ResetPeer(a.peer))
            case _:
                super()._do_role(a, out)

    def _start_write(self, a: StartWrite, out: list[RequestOutput]) -> None:
        """Hand the write to the transfer thread; one whose hand-over raises failed and cannot land."""
        try:
            spans = tuple(page_spans(a.src_pages, a.dst_pages, self.engine.layout.page_nbytes))
            self.transfer.submit(Write(a.room, a.write_id, a.peer, spans))
        except Exception as exc:
            # Never handed to the transfer thread, so nothing would ever settle it and its
            # room would hold its pages for good: it failed, and cannot land.
            out += self._handle_event(WriteFailed(a.room, a.write_id, f"not started: {type(exc).__name__}: {exc}"))
            raise
        self.kv_bytes_written += sum(span.nbytes for span in spans)

    def _send(self, peer: Peer, msg) -> None:
        if isinstance(msg, p.KVDone):  # rides behind the data, as the transfer's notification
            self.transfer.submit(Notify(peer, p.encode(msg)))
        else:
            self.control.send(peer, msg)

    def _success(self, rec: RoomRecord) -> list[RequestOutput]:
        first = rec.seq.token_ids[-1] if rec.seq is not None else None
        return [RequestOutput(rid=rec.req.rid, token_ids=(first,) if first is not None else (), finished=True,
                              finish_reason="prefill_done", prompt_tokens=len(rec.req.prompt_ids),
                              completion_tokens=0)]

    def _disconnect(self, a: DisconnectPeer) -> None:
        # our side of its transfer: its writes are reported failed (not a fence: decode's is), then
        # the control thread forgets the session (each owed if its hand-over raises)
        self.handovers.hand_over(f"the transfer reset of session {a.peer}",
                                 functools.partial(self.transfer.submit, ResetPeer(a.peer, forget=True)))
        super()._disconnect(a)

    def _close(self) -> None:
        if self.backend is not None:
            self.backend.close()
