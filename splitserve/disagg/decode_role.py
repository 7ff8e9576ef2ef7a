"""The decode role: reserves pages, registers them with the prefill worker, and decodes once the KV
landed (``docs/protocol.md``). Its table is a :class:`~splitserve.disagg.lifecycle.DecodeTable`.

Pages: a room asks for its prompt's pages (``ReservePages``) and waits in the **page queue** —
first come, first served, room ids checked against their record at the head, so an ended room
never blocks the ones behind it. It takes the pages of its prompt's longest prefix in this
worker's prefix cache (read-only: registered as ``cached_tokens``, never a write target), then new
pages for the rest, which prefill writes. Reserved pages are the record's until ``StartDecode``
gives them to the room's sequence; pages a remote write may still reach stay quarantined on the
record until the table releases them.

A request with no bootstrap fields (*decode alone*) gets a local room id (negative, never a
router's) and its prompt runs here (``ComputePrompt``); so does a room whose KV will not come,
under ``--kv-failure-policy recompute`` (``docs/lifecycle.md``, *The fallback*), once the table
knows no write can reach its pages and the link's permission for them is revoked. A request with
n > 1 choices is one room: the engine forks its other choices from the room's sequence; the room
finishes with its last choice. From the engine's step report the role takes ``PromptChunk``,
``DecodeStep`` / ``Finished`` and ``LocalFailure``; a preempted decoding sequence recomputes its
KV locally (its writes have all landed).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import Counter, OrderedDict, deque

from splitserve.disagg import protocol as p
from splitserve.disagg.control import DecodeControl
from splitserve.disagg.control.decode_client import ZmqDealer
from splitserve.disagg.lifecycle import (
    Admitted, ComputePrompt, DecodeStep, DecodeTable, DisconnectPeer, Finished, FromPeer, KVFallback, KVLost,
    LocalFailure, PagesReserved, Peer, Preempted, PromptChunk, QuarantinePages, Reason, ReleaseQuarantine,
    ReservePages, StartDecode,
)
from splitserve.disagg.lifecycle.recompute import KV_FALLBACK_REASONS
from splitserve.disagg.role import DisaggRole, RoomRecord
from splitserve.disagg.transfer.links import ReceiveLinks
from splitserve.disagg.transfer.thread import KVNotification, TransferWorker
from splitserve.engine.engine import StepReport
from splitserve.engine.io import GenerateRequest, RequestOutput
from splitserve.engine.page_allocator import page_keys
from splitserve.engine.worker_stats import DecodeStats
from splitserve.log_sparsely import worth_logging

log = logging.getLogger(__name__)
EARLY_KV_LOST = 1024  # router's prefill_failed kept for requests not here yet (the oldest forgotten first)


class DecodeRole(DisaggRole):
    name = "decode"
    links = None

    def _start(self) -> None:
        self.links = (self.seams.links or ReceiveLinks)(self.server.transfer_backend, f"decode-{self.incarnation}",
                                                        self.engine.kv.buffer, page_nbytes=self.engine.layout.page_nbytes,
                                                        **self._transfer_opts())
        self._unfenced: dict[Peer, set[int]] = {}  # a peer whose fence raised -> its rooms whose pages stay
        self.transfer = TransferWorker(None, self.post, self.faults.transfer, links=self.links)
        self.table = DecodeTable(self.deadlines, self.incarnation, self.engine.layout.page_size,
                                 vocab_size=self.engine.spec.vocab_size,
                                 kv_failure_policy=self.server.kv_failure_policy)
        self._local_rooms = itertools.count(-1, -1)  # rooms of requests that came alone: never a router's
        # reason -> rooms that recomputed their prompt (KVFallback); every reason from 0, so the
        # metric's series exist before the first fallback (a rate over them needs a start)
        self.fallbacks: Counter = Counter({r.value: 0 for r in KV_FALLBACK_REASONS})
        self.prompts_computed = 0  # a counter: rooms whose prompt ran here (alone, or a fallback)
        self._kv_lost_early: OrderedDict = OrderedDict()  # rid or ("room", n) -> detail: KVLost before its request
        self._page_queue: deque[int] = deque()  # rooms waiting for pages, first come first served
        self.pages_quarantined = 0
        self.kv_bytes_received = 0  # a counter: KV bytes prefill wrote into this worker's pages
        name = f"{self.advertise_host}:{self.server.port}"
        self.control = DecodeControl(name, self.info, self.links, self.post, self.deadlines,
                                     self.faults.control, lambda: not self.loop.loop_stalled(),
                                     dial=self.seams.dial or functools.partial(ZmqDealer, secret=self.secret),
                                     io_probe=self._io_probe(), wake=self.seams.control_wake)

    def _own_stats(self) -> DecodeStats:
        return DecodeStats(kv_transfer_bytes=self.kv_bytes_received, pages_quarantined=self.pages_quarantined,
                           links_open=len(self.links.writers()), links_fenced=self.links.fenced,
                           kv_fallbacks=dict(self.fallbacks), prompts_computed=self.prompts_computed)

    def check(self, req: GenerateRequest) -> None:
        self.engine.check_fits(req, split=req.bootstrap is not None)  # without bootstrap fields: served alone

    @staticmethod
    def computes_prompt(req: GenerateRequest) -> bool:
        """Whether this worker computes the request's prompt on arrival: alone, not a split leg."""
        return req.bootstrap is None

    def admit(self, req: GenerateRequest) -> list[RequestOutput]:
        if req.bootstrap is None:
            return self._admit_room(req, next(self._local_rooms), alone=True)
        return super().admit(req)

    def _arrived(self, rec, out: list[RequestOutput]) -> None:
        if rec is not None and not rec.answered and rec.req.bootstrap is not None:
            early = self._kv_lost_early
            detail = early.pop(rec.req.rid, None) or early.pop(("room", rec.room), None)
            if detail is not None:  # the router said so before the request came: it will not wait for prefill
                out += self._handle_event(KVLost(rec.room, detail))
                return
            self.control.want_info(rec.room, rec.req.bootstrap.host, rec.req.bootstrap.port)

    def abort_request(self, rid, room, kv_lost: bool, detail: str):
        """As :meth:`DisaggRole.abort_request`; a ``prefill_failed`` for a request not here yet
        (the router's two legs race) is kept for it, at most ``EARLY_KV_LOST`` of them."""
        found, out = super().abort_request(rid, room, kv_lost, detail)
        if not found and kv_lost:
            self._kv_lost_early[rid if rid is not None else ("room", room)] = detail
            while len(self._kv_lost_early) > EARLY_KV_LOST:
                self._kv_lost_early.popitem(last=False)
        return found, out

    def on_event(self, event: object) -> list[RequestOutput]:
        if isinstance(event, KVNotification):
            return self._on_notification(event)
        return super().on_event(event)

    def tick(self, now: float) -> list[RequestOutput]:
        if self._unfenced:
            self._fence_again()
        out = super().tick(now)
        self._serve_page_queue(out)
        return out

    def after_step(self, report: StepReport) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        for seq in report.preempted:  # waits for its turn again: no stall while it does
            if (rec := self.rooms.get(seq.room)) is not None and rec.seq is seq:
                out += self._handle_event(Preempted(rec.room))
        for seq in report.admitted:  # its turn came (the scheduler's admission): its progress bound starts
            if (rec := self.rooms.get(seq.room)) is not None and rec.seq is seq:
                out += self._handle_event(Admitted(rec.room))
        for seq in report.chunks:
            if (rec := self._record_of(seq)) is not None and rec.seq is seq:  # not a choice > 0's
                out += self._handle_event(PromptChunk(rec.room))
        for seq, delta in report.sampled:
            if (rec := self._record_of(seq)) is not None:
                out.append(delta)
                self._after_token(rec, delta, out)
        for seq, failed in report.failed:
            if (rec := self._record_of(seq)) is not None:
                out += self._handle_event(LocalFailure(rec.room, Reason.INTERNAL_ERROR, failed.error))
        return out

    def _after_token(self, rec: RoomRecord, delta: RequestOutput, out: list[RequestOutput]) -> None:
        if delta.finished:
            reason = Reason.STOP if delta.finish_reason == "stop" else Reason.LENGTH
            out += self._handle_event(Finished(rec.room, reason))
        else:
            out += self._handle_event(DecodeStep(rec.room))

    def _on_notification(self, ev: KVNotification) -> list[RequestOutput]:
        try:
            msg = p.decode(ev.payload)
        except p.ProtocolError as exc:
            self.notices["bad_notification"] += 1
            log.warning("bad transfer notification from %s: %s", ev.agent_name, exc)
            return []
        if getattr(msg, "incarnation", None) != ev.peer.incarnation:
            self.notices["notification_from_unknown_peer"] += 1
            log.warning("notification %s from %s arrived on the link of %s", type(msg).__name__, ev.agent_name,
                        ev.peer)
            return []
        return self._handle_event(FromPeer(ev.peer, msg))

    # -- actions --------------------------------------------------------------------------------

    def _do_role(self, a, out: list[RequestOutput]) -> None:
        match a:
            case ReservePages():
                self.rooms[a.room].want_pages = a.n_pages
                self._page_queue.append(a.room)  # waits its turn; the PREALLOC deadline bounds it
                self._serve_page_queue(out)
            case StartDecode():
                self._start_decode(a, out)
            case ComputePrompt():
                self._compute_prompt(a, out)
            case KVFallback():
                self.fallbacks[a.reason.value] += 1
                log.info("decode: room %d (%s) falls back to computing its prompt here: %s: %s", a.room, a.rid,
                         a.reason.value, a.detail)
            case QuarantinePages():
                rec = self.rooms[a.room]
                rec.pages, rec.quarantined = rec.take_pages(), True
                self.pages_quarantined += len(rec.pages)
            case ReleaseQuarantine():
                rec = self.rooms.get(a.room)
                if rec is not None and not self._kept_unfenced(rec):
                    self.pages_quarantined -= len(rec.pages)
                    rec.quarantined = False
                    self._free_room(a.room)
            case _:
                super()._do_role(a, out)

    def _start_decode(self, a: StartDecode, out: list[RequestOutput]) -> None:
        """Every write of the room landed: its pages become its sequence's, which decodes from the
        first token prefill sampled."""
        rec = self.rooms[a.room]
        self.links.revoke(a.room)  # every write landed: the pages are closed to prefill before they decode
        seq, outputs = self.engine.start_decoding(rec.req, rec.pages, a.first_token,  # checks before it changes
                                                  cached_pages=rec.cached_pages, first_logprobs=a.first_logprobs)
        self.kv_bytes_received += (len(rec.pages) - rec.cached_pages) * self.engine.layout.page_nbytes
        rec.seq, rec.pages = seq, []  # the pages are the sequence's now
        for delta in outputs:
            out.append(delta)
            if delta.finished:
                self._after_token(rec, delta, out)

    def _compute_prompt(self, a: ComputePrompt, out: list[RequestOutput]) -> None:
        """The room's prompt runs here, into its own pages (its cached prefix kept): closed to every
        prefill's link first. A room of a peer whose fence failed may still be written: it fails
        with its reason instead (its pages stay quarantined, ``_kept_unfenced``)."""
        rec = self.rooms[a.room]
        if any(a.room in rooms for rooms in self._unfenced.values()):
            out += self._handle_event(LocalFailure(a.room, a.reason or Reason.INTERNAL_ERROR,
                                           "its KV will not come, and its pages may still be written by a prefill "
                                           "whose fence failed: not recomputed"))
            return
        self.links.revoke(a.room)
        seq = self.engine.start_prefill(rec.req, rec.pages, a.room, cached_pages=rec.cached_pages)
        rec.seq, rec.pages = seq, []  # the pages are the sequence's now
        self.prompts_computed += 1

    def _serve_page_queue(self, out: list[RequestOutput]) -> None:
        """Give pages to the rooms at the head of the queue while they fit — first the pages of
        the prompt's longest prefix in this worker's cache (shared, read-only: prefill will not
        write them), then new ones for the rest; an entry whose record no longer wants pages is
        dropped on the way."""
        queue, allocator, page_size = self._page_queue, self.engine.allocator, self.engine.layout.page_size
        while queue:
            rec = self.rooms.get(queue[0])
            if rec is None or not rec.want_pages:
                queue.popleft()
                continue
            prompt = rec.req.prompt_ids
            cached = allocator.match(page_keys(prompt, page_size, (len(prompt) - 1) // page_size, rec.req.cache_salt)) \
                if allocator.cache_enabled and rec.req.sampling.prompt_logprobs is None else []  # those compute all
            if not allocator.can_allocate(rec.want_pages - len(cached)):
                allocator.free(cached)  # taken again when the room's turn comes
                return  # first come, first served
            queue.popleft()
            rec.pages = cached + allocator.allocate(rec.want_pages - len(cached))
            rec.want_pages, rec.cached_pages = 0, len(cached)
            self.engine.scheduler.cache_hit_tokens += len(cached) * page_size
            out += self._handle_event(PagesReserved(rec.room, tuple(rec.pages), len(cached) * page_size))

    def _send(self, peer: Peer, msg) -> None:
        if isinstance(msg, p.RegisterRoom):  # its target pages open to that prefill's link, before it can write
            self.links.allow(peer, msg.room, msg.pages)
            self.transfer.wake()  # it polls the links fast only while a room's KV is due
        super()._send(peer, msg)

    def _free_room(self, room: int, named=None) -> None:
        rec = self.rooms.get(room)
        if rec is not None and self._kept_unfenced(rec):
            return
        if rec is not None:  # closed to the link before they are free
            self.links.revoke(room, None if rec.gives_back_all(named) else named)
        super()._free_room(room, named)

    def _kept_unfenced(self, rec: RoomRecord) -> bool:
        """A room of a peer whose fence failed, before its KV was complete (``StartDecode``: after it
        every write has landed): its pages stay quarantined — a late write may still land in them —
        until a fence goes through (True: kept)."""
        if rec.seq is not None or not any(rec.room in rooms for rooms in self._unfenced.values()):
            return False
        if not rec.quarantined:
            rec.pages, rec.quarantined = rec.take_pages(), True
            self.pages_quarantined += len(rec.pages)
        return True

    def _disconnect(self, a: DisconnectPeer) -> None:
        # The fence, before any page of the peer's rooms is freed by the actions that follow;
        # then the control thread ends the session (the next room for that address opens a new one).
        try:
            self.links.close(a.peer)
        except Exception:  # unfenced: its rooms' pages are kept (_kept_unfenced) until a fence goes through
            self.notices["fence_failed"] += 1
            log.exception("decode: fencing %s failed; the pages of its %d rooms stay quarantined until a fence "
                          "goes through (tried again at every tick)", a.peer, len(a.rooms))
            self._unfenced.setdefault(a.peer, set()).update(a.rooms)
        super()._disconnect(a)

    def _fence_again(self) -> None:
        """Every tick: the fences that failed, tried again (each on its own: one that keeps failing
        holds up nothing else); once one goes through, its rooms' kept pages are released."""
        for peer in list(self._unfenced):
            try:
                self.links.close(peer)
            except Exception:
                n = self.notices["fence_failed"] = self.notices["fence_failed"] + 1
                if worth_logging(n):
                    log.exception("decode: fencing %s failed again (%d fence failures so far)", peer, n)
                continue
            self._release_unfenced(peer)

    def _release_unfenced(self, peer: Peer) -> None:
        for room in self._unfenced.pop(peer, ()):
            rec = self.rooms.get(room)
            if rec is not None and rec.quarantined and rec.seq is None:
                log.info("decode: %s fenced at last: room %d's %d quarantined pages released", peer, room,
                         len(rec.pages))
                self.pages_quarantined -= len(rec.pages)
                rec.quarantined = False
                self._free_room(room)  # closed to the link (revoked), then free

    def _close(self) -> None:
        if self.links is not None:
            self.links.close_all()
