"""Continuous batching with chunked prefill and preemption, under one admission and ordering policy.

Every step the scheduler picks, under a token budget, how many new tokens each sequence computes
(one when decoding, a prompt chunk otherwise): running ones first, short prompts between a long
one's chunks, chunks beside decoding held to a measured budget (design.md, *A step's tokens*).

**Admission and order** (``docs/design.md``, *Admission and order*, has the rules and their
price): a request is the unit, its **need** (:func:`request_pages`) the measure; a need larger than
the pool is refused at submission (``check_fits``). Requests wait in arrival order
(``Sequence.order``: its choices and preempted sequences keep the ticket); a waiting request is
*promised* its need when that fits in the pages no admitted request may still grow into
(:meth:`Scheduler.unpromised_pages`), and keeps the promise until it ends; a request that does not
fit lets at most ``max_passes`` later ones pass it. Preemption is only for pages that leave the
scheduler's account (a decode room's): the latest request's sequence waits again, still promised.

A prefill-only sequence gets its whole prompt's pages when admitted and is never preempted; a
room's sequence is taken out by ``detach`` (its room frees the pages). A sequence admitted with no
pages first takes the cached pages of its longest known prefix, never its last token
(``page_allocator.py``); every page full of computed KV is offered to the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from splitserve.engine.page_allocator import PageAllocator, page_keys
from splitserve.engine.sequence import Sequence, SeqStatus


MAX_PASSES = 32
"""How many later requests may pass one whose need does not fit before nothing more passes it
(each pass can delay it by at most that request's own run)."""

PROMPT_LOGPROBS_CHUNK = 512
"""Prompt tokens a step computes for a sequence that wants its prompt's logprobs: the logits of
each are kept (512 x a 49,152-token vocabulary: 100 MB of float32)."""


def request_pages(prompt_tokens: int, max_tokens: int, n: int, page_size: int, shared_prefix: bool) -> int:
    """The most pages a request's sequences hold at once: each of its ``n`` choices its prompt plus
    ``max_tokens``; with ``shared_prefix`` (the prefix cache on) the prompt's full pages but its last
    token's, which every choice takes from the cache, once."""
    each = -(-(prompt_tokens + max_tokens) // page_size)
    shared = (prompt_tokens - 1) // page_size if shared_prefix and n > 1 else 0
    return shared + n * (each - shared)


def _prompt_left(seq: Sequence) -> int:
    return max(0, seq.num_prompt_tokens - seq.num_computed)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so a new one is sampled."""
        return self.seq.num_computed + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_running: int,
                 max_batch_tokens: int, chunked_prefill: bool, max_passes: int = MAX_PASSES):
        self.allocator = allocator
        self.page_size = page_size
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill = chunked_prefill
        self.max_passes = max_passes
        self.waiting: deque[Sequence] = deque()  # in order (``Sequence.order``)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.cache_hit_tokens = 0  # prompt tokens admitted from the prefix cache (a counter)
        self.admitted: list[Sequence] = []  # admitted by the last schedule()
        self.preempted: list[Sequence] = []  # preempted by the last schedule()
        self._tickets = 0  # orders drawn
        self._chunk_cap: Optional[int] = None  # prompt tokens this step's chunks may still take (schedule)
        self.prompt_backlog = 0
        """Prompt tokens of the queued and running sequences not computed yet, as of the last
        ``add`` or ``schedule``: what a new request's prompt waits behind (``prompt_rate.py``;
        any thread may read it)."""

    def add(self, seq: Sequence, request: Optional[Sequence] = None) -> None:
        """Queue a sequence in its request's place: a new request draws the next ticket; a choice
        of ``request`` (its first sequence) takes that request's ticket and promise."""
        if request is not None:
            if request.order < 0:
                request.order = self._draw()
            seq.order, seq.promised = request.order, request.promised
        elif seq.order < 0:
            seq.order = self._draw()
        self._enqueue(seq)
        self.prompt_backlog += _prompt_left(seq)

    def _draw(self) -> int:
        self._tickets += 1
        return self._tickets

    def _enqueue(self, seq: Sequence) -> None:
        """Into ``waiting`` behind every sequence of its order or earlier (a new one: at the end)."""
        at = len(self.waiting)
        while at and self.waiting[at - 1].order > seq.order:
            at -= 1
        self.waiting.insert(at, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prompt_budget: Optional[int] = None) -> list[ScheduledSeq]:
        """This step's batch. ``prompt_budget``: when a running sequence decodes this step, the
        most tokens the step's prompt chunks (every sequence computing more than one token) may
        take together (``step_pace.py``: so decode keeps its pace); None: only ``max_batch_tokens``."""
        budget = self.max_batch_tokens
        batch: list[ScheduledSeq] = []
        self.admitted, self.preempted = [], []
        self._chunk_cap = self._prompt_cap(prompt_budget)
        room, half = self._room_for_short(), self.max_batch_tokens // 2
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > half):  # long prompts' chunks last
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, max(0, budget - room) if seq.num_uncomputed > 1 else budget, batch_empty=not batch)
            if n == 0:
                continue
            if not self._reserve(seq, n, batch):
                continue  # seq itself was preempted
            batch.append(ScheduledSeq(seq, n))
            budget -= n
            self._charge(n)
        self._admit(budget, batch)
        self._count_backlog(batch)
        return batch

    def _room_for_short(self) -> int:
        """Tokens of this step's budget that running prompt chunks leave to short prompts waiting
        at the head of the queue (each with at most half the budget to compute, in order, that
        are or can be promised their need), at most half the budget: a short prompt runs between
        a long prompt's chunks instead of after its last (module docstring)."""
        half = self.max_batch_tokens // 2
        if not self.chunked_prefill or not any(s.num_uncomputed > half for s in self.running):
            return 0
        want, slack = 0, None
        for seq in self.waiting:
            if seq.num_uncomputed > half or want >= half:
                break
            if not seq.promised:
                slack = self.unpromised_pages() if slack is None else slack
                need = self.request_need(seq)
                if need > slack:
                    break
                slack -= need
            want += seq.num_uncomputed
        return min(want, half)

    def _prompt_cap(self, prompt_budget: Optional[int]) -> Optional[int]:
        """This step's prompt tokens beside decoding sequences: ``prompt_budget`` times the
        prompts waiting for their first token per decoding sequence (at least once), so that one
        stream decoding does not hold fifteen prompts to a trickle: the stall each decoding
        stream takes is set against the wait of every prompt it would hold up. None: no cap."""
        if prompt_budget is None or not self.chunked_prefill:
            return None
        decoding = sum(1 for s in self.running if s.decoding)
        if not decoding:
            return None
        prompts = len(self.waiting) + sum(1 for s in self.running if s.num_uncomputed and not s.decoding)
        return prompt_budget * max(1, prompts // decoding)

    def _charge(self, n: int) -> None:
        """A chunk of ``n`` tokens joined the batch: more than one is a prompt chunk, on the cap."""
        if self._chunk_cap is not None and n > 1:
            self._chunk_cap = max(0, self._chunk_cap - n)

    def _count_backlog(self, batch: list[ScheduledSeq] = ()) -> None:
        """``prompt_backlog`` anew: what stays uncomputed once ``batch`` (this step's) has run."""
        left = sum(map(_prompt_left, self.waiting)) + sum(map(_prompt_left, self.running))
        self.prompt_backlog = max(0, left - sum(min(s.num_tokens, _prompt_left(s.seq)) for s in batch))

    # -- admission and order (module docstring) -------------------------------------------------

    def request_need(self, seq: Sequence) -> int:
        """The need of the request whose first sequence ``seq`` is (:func:`request_pages`)."""
        if seq.prefill_only:
            return -(-seq.num_prompt_tokens // self.page_size)
        return request_pages(seq.num_prompt_tokens, seq.sampling.max_tokens, seq.sampling.n, self.page_size,
                             self.allocator.cache_enabled)

    def _growth(self, seq: Sequence) -> int:
        """Pages ``seq`` may still take, and its request's choices not forked yet."""
        if seq.prefill_only:
            return max(0, self.request_need(seq) - len(seq.pages))
        each = -(-(seq.num_prompt_tokens + seq.sampling.max_tokens) // self.page_size)
        shared = (seq.num_prompt_tokens - 1) // self.page_size if self.allocator.cache_enabled else 0
        if seq.continued:  # a continuation's choices are each a whole sequence, none forks
            return max(0, each - len(seq.pages))
        held = len(seq.pages) if seq.pages else shared if seq.choice else 0  # a choice > 0 shares the prompt
        forks = seq.sampling.n - 1 if seq.choice == 0 and not seq.num_output_tokens else 0
        return max(0, each - held) + forks * (each - shared)

    def unpromised_pages(self) -> int:
        """Pages that no promised sequence may still take: what a new request's need must fit in."""
        owed = sum(self._growth(s) for s in self.running)
        owed += sum(self._growth(s) for s in self.waiting if s.promised)
        return self.allocator.num_available - owed

    def _groups(self) -> list[list[Sequence]]:
        """The waiting sequences by request (one order), in order."""
        groups: list[list[Sequence]] = []
        for seq in self.waiting:
            if groups and groups[-1][0].order == seq.order:
                groups[-1].append(seq)
            else:
                groups.append([seq])
        return groups

    def _admit(self, budget: int, batch: list[ScheduledSeq]) -> None:
        """Promise waiting requests their need in order, with patience (module docstring), and
        start promised sequences in order while the running cap, the budget and pages allow."""
        slack = self.unpromised_pages()
        blocked: list[Sequence] = []  # first sequences of requests that did not fit, in order
        held = False  # one of them was passed max_passes times: nothing more is promised
        for group in self._groups():
            if not group[0].promised:
                need = min(sum(self._growth(s) for s in group), self.allocator.num_pages)
                if held or need > slack:
                    blocked.append(group[0])
                    held = held or group[0].passed >= self.max_passes
                    continue
                slack -= need
                for seq in group:
                    seq.promised = True
                for b in blocked:
                    b.passed += 1
                    held = held or b.passed >= self.max_passes
            for seq in group:
                if len(self.running) >= self.max_running or budget <= 0:
                    return
                n = self._start(seq, budget, batch)
                if not n:
                    return  # in order: no later sequence starts before it
                budget -= n
                self._charge(n)

    def _start(self, seq: Sequence, budget: int, batch: list[ScheduledSeq]) -> int:
        """Move a promised waiting sequence into the batch if its first chunk's pages are free;
        the tokens it computes this step (0: it waits)."""
        matched = self._take_cached_prefix(seq)
        n = self._chunk(seq, budget, batch_empty=not batch)
        upfront = seq.num_uncomputed if seq.prefill_only else n
        if n == 0 or not self.allocator.can_allocate(self._pages_missing(seq, upfront)):
            if matched:  # give the cached prefix back: it is taken again when the sequence fits
                self._release(seq)
                seq.num_computed = seq.indexed = 0
            return 0
        if matched:
            self.cache_hit_tokens += seq.num_computed
            seq.cached_tokens = seq.num_computed
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.admitted.append(seq)
        self._grow(seq, upfront)
        batch.append(ScheduledSeq(seq, n))
        return n

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence for good (finished or aborted) and free its pages, exactly once;
        a room's sequence is only detached (its room frees the pages)."""
        if seq.room is not None:
            self.detach(seq)
            return
        self._remove(seq)
        seq.status = SeqStatus.FINISHED
        self._release(seq)

    def detach(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and the batch, keeping its pages (state HELD)."""
        self._remove(seq)
        seq.status = SeqStatus.HELD

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._count_backlog()  # an aborted prompt is no backlog, also while the engine idles

    def _chunk(self, seq: Sequence, budget: int, batch_empty: bool) -> int:
        need = seq.num_uncomputed
        if seq.wants_prompt_logprobs:  # every row's logits are kept this step: bound them
            need = min(need, PROMPT_LOGPROBS_CHUNK)
        if self.chunked_prefill:
            if need > 1 and self._chunk_cap is not None:  # beside decoding sequences (schedule)
                need = min(need, self._chunk_cap)
            return min(need, budget)
        # unchunked: all of it, over budget only when alone in the batch
        return need if (need <= budget or batch_empty) else 0

    def _pages_missing(self, seq: Sequence, n: int) -> int:
        need = -(-(seq.num_computed + n) // self.page_size)
        return max(0, need - len(seq.pages))

    def _grow(self, seq: Sequence, n: int) -> None:
        missing = self._pages_missing(seq, n)
        seq.pages += self.allocator.allocate(missing, after=seq.pages[-1] if seq.pages else None)

    def _reserve(self, seq: Sequence, n: int, batch: list[ScheduledSeq]) -> bool:
        """Make pages for ``n`` more tokens of a running seq, preempting from the tail if needed."""
        while not self.allocator.can_allocate(self._pages_missing(seq, n)):
            victim = max((s for s in self.running if not s.prefill_only), key=lambda s: s.order, default=None)
            if victim is None:
                return False  # nothing may be preempted: the sequence waits for pages
            self._preempt(victim)
            if victim is seq:
                return False
            batch[:] = [s for s in batch if s.seq is not victim]
        self._grow(seq, n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = seq.indexed = 0
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)  # in its request's place, still promised
        self.num_preemptions += 1
        self.preempted.append(seq)

    def release(self, seq: Sequence) -> None:
        """Free a held sequence's pages (its room's FreePages), exactly once."""
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []

    # -- the prefix cache ---------------------------------------------------------------------------

    def keys(self, seq: Sequence, n: int) -> list:
        """The prefix-cache keys of the sequence's first ``n`` full pages (memoized on it)."""
        have = len(seq.page_keys)
        if have < n:
            parent = seq.page_keys[-1] if have else seq.salt_key  # the salt was hashed at admission
            seq.page_keys += page_keys(seq.token_ids[have * self.page_size:], self.page_size, n - have,
                                       parent=parent)
        return seq.page_keys[:n]

    def _take_cached_prefix(self, seq: Sequence) -> bool:
        """A sequence with no pages (new, or preempted) takes the cached pages of its longest known
        prefix, all but its last token (which is always computed, into a page of its own). True
        if it had none and looked (whatever it found)."""
        if seq.pages or seq.num_computed or not self.allocator.cache_enabled or seq.wants_prompt_logprobs:
            return False
        pages = self.allocator.match(self.keys(seq, (len(seq) - 1) // self.page_size))
        seq.pages, seq.indexed = pages, len(pages)
        seq.num_computed = len(pages) * self.page_size
        return True

    def index_computed(self, seq: Sequence) -> None:
        """Offer the prefix cache every page of ``seq`` that is now full of computed KV."""
        full = min(seq.num_computed // self.page_size, len(seq.pages))
        if seq.indexed >= full or not self.allocator.cache_enabled:
            return
        for i, key in enumerate(self.keys(seq, full)[seq.indexed:], start=seq.indexed):
            self.allocator.insert(seq.pages[i], key)
        seq.indexed = full
