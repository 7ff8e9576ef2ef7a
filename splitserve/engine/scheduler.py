"""Continuous batching with chunked prefill and preemption.

Every step the scheduler picks, under a token budget, how many new tokens each sequence computes:
one for a decoding sequence, a chunk of its prompt for one still in prefill (the whole rest of the
prompt when chunking is off). Running sequences go first, in arrival order; then waiting ones are
admitted in order while the running cap, the budget and free pages allow, so requests join the
batch at any step.

When a running sequence needs a page and none is free, the most recently arrived running sequence
is preempted: its pages are freed and it goes back to the front of the waiting queue, to recompute
later. A request is never dropped for lack of pages; one that could never fit the whole pool is
refused at submission.

Disaggregated requests: a prefill-only sequence gets the pages of its whole prompt when admitted
(its room hands them to the transfer) and is never preempted; a sequence whose pages belong to a
room is never freed here on finish — ``detach`` takes it out and its room frees the pages.

Prefix cache (``page_allocator.py``): a sequence admitted with no pages (and not computing its
prompt's logprobs, which needs every prompt position computed) first takes the cached pages of its
longest known prefix (never its last token, which is always computed, so that no
cached page is ever written) and computes only the rest; every page that becomes full of computed
KV is offered to the cache (``index_computed``). Preempted or finished, its full pages stay cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitserve.engine.page_allocator import PageAllocator, page_keys
from splitserve.engine.sequence import Sequence, SeqStatus


PROMPT_LOGPROBS_CHUNK = 512
"""Prompt tokens a step computes for a sequence that wants its prompt's logprobs: the logits of
each are kept (512 x a 49,152-token vocabulary: 100 MB of float32)."""


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
                 max_batch_tokens: int, chunked_prefill: bool):
        self.allocator = allocator
        self.page_size = page_size
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.cache_hit_tokens = 0  # prompt tokens admitted from the prefix cache (a counter)
        self.admitted: list[Sequence] = []  # admitted by the last schedule()
        self.preempted: list[Sequence] = []  # preempted by the last schedule()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_batch_tokens
        batch: list[ScheduledSeq] = []
        self.admitted, self.preempted = [], []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget, batch_empty=not batch)
            if n == 0:
                continue
            if not self._reserve(seq, n, batch):
                continue  # seq itself was preempted
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            seq = self.waiting[0]
            matched = self._take_cached_prefix(seq)
            n = self._chunk(seq, budget, batch_empty=not batch)
            upfront = seq.num_uncomputed if seq.prefill_only else n
            if n == 0 or not self.allocator.can_allocate(self._pages_missing(seq, upfront)):
                if matched:  # give the cached prefix back: it is taken again when the sequence fits
                    self._release(seq)
                    seq.num_computed = seq.indexed = 0
                break
            if matched:
                self.cache_hit_tokens += seq.num_computed
                seq.cached_tokens = seq.num_computed
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.admitted.append(seq)
            self._grow(seq, upfront)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

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

    def _chunk(self, seq: Sequence, budget: int, batch_empty: bool) -> int:
        need = seq.num_uncomputed
        if seq.wants_prompt_logprobs:  # every row's logits are kept this step: bound them
            need = min(need, PROMPT_LOGPROBS_CHUNK)
        if self.chunked_prefill:
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
            victim = next((s for s in reversed(self.running) if not s.prefill_only), None)
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
        self.waiting.appendleft(seq)
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
