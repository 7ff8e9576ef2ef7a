"""The engine: one worker's model, KV pool, scheduler and requests, advanced one step at a time.

``LLMEngine`` is synchronous and single-threaded: the engine loop (``async_engine.py``) owns it and
is the only caller, so no request state is ever touched by two threads (``docs/lifecycle.md``,
rule 1). Offline users (benchmarks, tests) call it directly: ``add_request`` then ``step`` until
idle.

Each ``step`` schedules a batch, runs it, samples one token for each sequence whose known tokens
are all computed, and returns a :class:`StepReport` (admitted, prompt chunks run, prefill-only
first tokens, sampled tokens with their client deltas, finished, preempted, failed): whoever drives
the engine reads only that report. A finished or aborted sequence's pages are freed exactly once,
in ``Scheduler.finish``; a sequence whose pages belong to a room is only detached.

A request with ``n`` > 1 choices is one sequence until its prompt has run; then the other choices
fork from it (``_fork``: sequences keyed ``rid + CHOICE_KEY + i`` that take the prompt's full
pages from the prefix cache, compute its partial last page and sample their own first token with
``choice_seed``), the same wherever the prompt ran (a prefill worker's room samples choice 0's
first token only; ``start_decoding`` forks the rest). The request ends with its last choice, and an
abort (or a room's ``cancel``) ends them all.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch

from splitserve.config import EngineConfig
from splitserve.engine.continuation import replay
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.grammar import GrammarError
from splitserve.engine.io import GenerateRequest, InvalidRequest, RequestOutput, TokenLogprob
from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.page_allocator import PageAllocator, salt_key
from splitserve.engine.sampler import (
    NoFiniteLogits, adjust_logits, choice_seed, greedy_tokens, sample_token, token_logprobs,
)
from splitserve.engine.scheduler import ScheduledSeq, Scheduler, request_pages
from splitserve.engine.sequence import Sequence
from splitserve.outcomes import Ending, Reason

log = logging.getLogger(__name__)

CHOICE_KEY = "\x1f"
"""Between a request's id and a choice's index in the engine's key of choice i > 0 (a request id
is printable: no client's id can take a choice's key)."""


@dataclass
class StepReport:
    """What one :meth:`LLMEngine.step` did."""

    admitted: list[Sequence] = field(default_factory=list)
    """Took their first pages this step (a prefill-only sequence: those of its whole prompt)."""
    chunks: list[Sequence] = field(default_factory=list)
    """Computed a chunk of their prompt and sampled nothing yet."""
    first_tokens: list[Sequence] = field(default_factory=list)
    """Prefill-only: the whole prompt ran and the first token was sampled (the last of
    ``token_ids``); the sequence is held, its pages kept for its room."""
    sampled: list[tuple[Sequence, RequestOutput]] = field(default_factory=list)
    """Every other sequence that produced a token, with the client's delta (``finished`` on the last)."""
    preempted: list[Sequence] = field(default_factory=list)
    """Lost their pages to make room; they recompute later."""
    failed: list[tuple[Sequence, RequestOutput]] = field(default_factory=list)
    """Were in a forward pass that raised, or their own token could not be sampled or checked:
    ended (out of every queue), with their error delta."""
    scheduled: int = 0
    """Sequences in the step's batch; 0: the engine had work and could schedule none of it (no
    pages for any: nothing changes until an event frees some)."""
    decoding: int = 0
    """Sequences in the batch computing one sampled token (``Sequence.decoding``: ``step_pace.py`` times them)."""

    @property
    def outputs(self) -> list[RequestOutput]:
        """The client deltas of this step, in batch order (what a colocated worker streams)."""
        return [out for _, out in self.sampled] + [out for _, out in self.failed]


@dataclass(frozen=True)
class EngineStats:
    pages_free: int
    pages_total: int
    pages_cached: int  # in the prefix cache, owned by no one (evictable)
    pages_owned: int  # held by sequences and rooms (a shared cached page once)
    waiting: int
    running: int
    preemptions: int
    cache_hit_tokens: int  # counters since start: prompt tokens found in the prefix cache...
    prompt_tokens_computed: int  # ...and prompt tokens computed
    cache_evictions: int
    unschedulable_steps: int  # a counter: steps with work of which nothing could be scheduled


@dataclass(frozen=True)
class ModelParts:
    """What the engine runs: the model, what it knows of it (``ModelSpec``), its tokenizer, and how
    a forward pass is run over the KV pool (``make_runner(model, kv, progress)`` -> an object whose
    ``run(batch)`` returns the logits [S, vocab] of the sequences that sample, calling ``progress()``
    as it goes). Production loads them from ``config.model`` (:func:`load_parts`); the simulator
    (``splitserve/sim/``) passes a fake forward pass, while the scheduler, pages, sequences and
    sampling stay this engine's."""

    model: object
    spec: object
    tokenizer: object
    make_runner: Callable = ModelRunner


def load_parts(config: EngineConfig) -> ModelParts:
    from splitserve.models.loader import load_model, load_tokenizer
    from splitserve.models.resolve import resolve_model_dir

    model_dir = resolve_model_dir(config.model)
    model, spec = load_model(model_dir, dtype=config.dtype, device=config.device, quantization=config.quantization)
    tokenizer = load_tokenizer(model_dir)
    if config.chat_template:  # --chat-template: this file, not the model's own
        from pathlib import Path

        tokenizer.chat_template = Path(config.chat_template).expanduser().read_text()
    else:  # SmolLM2's own renders no tools: the same with tools (models/smollm2_chat.py)
        from splitserve.models.smollm2_chat import tool_template

        tokenizer.chat_template = tool_template(tokenizer.chat_template) or tokenizer.chat_template
    return ModelParts(model, spec, tokenizer)


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: Optional[ModelParts] = None,
                 progress: Callable[[], None] = lambda: None):
        """``progress``: called during a forward pass (after each decoder layer), from this thread."""
        self.config = config
        parts = parts or load_parts(config)
        self.model, self.spec, self.tokenizer = parts.model, parts.spec, parts.tokenizer
        num_pages = -(-config.max_total_tokens // config.page_size)
        self.layout = KVLayout(num_pages=num_pages, num_layers=self.spec.num_layers, page_size=config.page_size,
                               num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_dim, dtype=self.spec.dtype,
                               kv_cache_dtype=config.kv_cache_dtype)
        self.kv = KVPool(self.layout, device=config.device)
        self.allocator = PageAllocator(num_pages, cache=config.prefix_cache)
        self.scheduler = Scheduler(self.allocator, config.page_size, config.max_running_requests,
                                   config.max_batch_tokens, config.chunked_prefill)
        self.prompt_tokens_computed = 0  # a counter: prompt tokens whose KV this engine computed
        self.unschedulable_steps = 0  # a counter: steps that found work and could schedule none of it
        self.runner = parts.make_runner(self.model, self.kv, progress)
        self._seqs: dict[str, Sequence] = {}  # every live sequence by its key (a choice > 0: CHOICE_KEY)
        self._open: dict[str, int] = {}  # a request with n > 1: its choices not yet ended
        self._forks: dict[str, list[Sequence]] = {}  # ... its choices > 0
        self._requests: dict[str, GenerateRequest] = {}  # ... the request, until its choices fork
        self._rng = random.Random(config.seed)
        self._eos = frozenset(self.spec.eos_token_ids)

    # -- requests -----------------------------------------------------------------------------

    def check_fits(self, req: GenerateRequest, prompt_only: bool = False, split: Optional[bool] = None) -> None:
        """Refuse a request that could never run: a need (``scheduler.request_pages``: every one of
        its ``n`` choices, the prompt's full pages shared) larger than the whole pool, or on a split
        (``split``; a prefill worker's always is) what must run on one worker. ``prompt_only``: a
        prefill worker holds the prompt's KV only."""
        if prompt_only if split is None else split:
            self._one_worker_only(req)
        pool = self.layout.total_tokens
        if prompt_only and len(req.prompt_ids) > pool:
            raise InvalidRequest(f"the prompt ({len(req.prompt_ids)} tokens) needs more KV cache than this "
                                 f"worker's pool holds ({pool} tokens)", param="prompt")
        if prompt_only:
            return
        p, m, n = len(req.prompt_ids), req.sampling.max_tokens, req.sampling.n
        need = request_pages(p, m, n, self.layout.page_size, self.config.prefix_cache)
        if need > self.layout.num_pages:
            each = f"prompt ({p} tokens) plus max_tokens ({m})"
            what = each if n == 1 else f"n ({n}) choices of {each}, the prompt's full pages shared,"
            raise InvalidRequest(f"{what} need {need} pages of {self.layout.page_size} tokens of KV cache, but "
                                 f"this worker's pool holds {self.layout.num_pages} ({pool} tokens)",
                                 param="max_tokens" if n == 1 else "n")

    def add_request(self, req: GenerateRequest, prefill_only: bool = False) -> Sequence:
        """Queue a request. ``prefill_only`` (prefill worker): run the prompt, sample the first
        token, then hold the sequence and its pages for the transfer (``StepReport.first_tokens``)."""
        if prefill_only:
            self._one_worker_only(req)
            if req.continuation is not None:
                raise InvalidRequest("a continuation is served by a decode or colocated worker", param="continuation")
        if req.continuation is not None:
            return self._continued(req)
        seq = self._new_sequence(req, room_owned=prefill_only, prefill_only=prefill_only)
        seq.prefill_only = prefill_only
        self._seqs[req.rid] = seq
        if not prefill_only:  # a prefill room's other choices fork on decode (start_decoding)
            self._choices(req)
        self.scheduler.add(seq)
        return seq

    def _continued(self, req: GenerateRequest, room: Optional[int] = None,
                   setup: Callable[[Sequence], None] = lambda seq: None) -> Sequence:
        """Queue a continuation (``req.continuation``) as a preempted request is queued: each
        choice named is a sequence of the prompt and its given ids, replayed through its grammar,
        stop matcher and detokenizer without a delta (their KV is computed as prompt chunks, and
        the penalties count them as tokens of the answer), then generating on with its own
        seed. The first choice named is keyed ``rid`` (``room``'s, after ``setup``), the others
        as forks. A choice whose last id ends it (the client lacks only its end) is computed and
        then ends with no token, as ``max_tokens`` 0 does. Raises InvalidRequest (changing
        nothing) for ids its grammar refuses or that end the choice before their last."""
        req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, prompt_logprobs=None))
        lead = self._new_sequence(req, room_owned=room is not None, room=room)
        seed, seqs = lead.seed, []
        for k, (index, ids) in enumerate(req.continuation.choices):
            seq = lead if k == 0 else Sequence(
                rid=f"{req.rid}{CHOICE_KEY}{index}", token_ids=list(req.prompt_ids),
                num_prompt_tokens=len(req.prompt_ids), sampling=req.sampling, seed=0,
                cache_salt=req.cache_salt, salt_key=lead.salt_key, request_rid=req.rid)
            if k:
                seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, req.sampling.stop, req.stop_matcher)
                seq.grammar = req.grammar.state() if req.grammar is not None else None
            seq.choice, seq.seed, seq.continued = index, choice_seed(seed, index), True
            self._replay(seq, ids, index)
            seqs.append(seq)
        setup(lead)
        self._seqs[req.rid] = lead
        self.scheduler.add(lead)
        if len(seqs) > 1:
            self._open[req.rid], self._forks[req.rid] = len(seqs), seqs[1:]
            for seq in seqs[1:]:
                self._seqs[seq.rid] = seq
                self.scheduler.add(seq, request=lead)
        return lead

    def check_continuation(self, req: GenerateRequest) -> None:
        """Replay a continuation's ids on throwaway state, from any thread (what it reads is read
        only): InvalidRequest for ids ``_continued`` would refuse, before a worker's role admits it."""
        for index, ids in req.continuation.choices:
            seq = Sequence(rid=req.rid, token_ids=list(req.prompt_ids), num_prompt_tokens=len(req.prompt_ids),
                           sampling=req.sampling, seed=0)
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, req.sampling.stop, req.stop_matcher)
            seq.grammar = req.grammar.state() if req.grammar is not None else None
            self._replay(seq, ids, index)

    def _replay(self, seq: Sequence, ids: tuple[int, ...], index: int) -> None:
        """Give ``seq`` the ids already streamed of its choice, emitting nothing (InvalidRequest:
        one outside the vocabulary, refused by its grammar, or one after the id that ended the
        choice); the last may end it (``seq.finish_reason`` set)."""
        param = "continuation.choices"
        for token in ids:
            if not 0 <= token < self.spec.vocab_size:
                raise InvalidRequest(f"choice {index}: token {token} is outside the vocabulary", param=param)
            if seq.finish_reason is not None:
                raise InvalidRequest(f"choice {index}: its ids end it ({seq.finish_reason}) before the last",
                                     param=param)
            if seq.grammar is not None:
                try:
                    seq.grammar.advance(token)
                except GrammarError as exc:
                    raise InvalidRequest(f"choice {index}: token {token}: {exc}", param=param) from None
            seq.token_ids.append(token)
            self._check_finish(seq, token, replayed=True)

    def _choices(self, req: GenerateRequest) -> None:
        """A request with n > 1: its choices fork from its first sequence once its prompt has run."""
        if req.sampling.n > 1:
            self._open[req.rid], self._forks[req.rid], self._requests[req.rid] = req.sampling.n, [], req

    def start_decoding(self, req: GenerateRequest, pages: list[int], first_token: int,
                       cached_pages: int = 0, first_logprobs: bytes = b"") -> tuple[Sequence, list[RequestOutput]]:
        """Decode worker: the prompt's KV is in ``pages`` — the first ``cached_pages`` from this
        worker's prefix cache, the rest written by a prefill worker — and prefill sampled
        ``first_token`` (and computed its logprobs, ``TokenLogprob.to_bytes``, when the request
        asks for them). Emits that token, then the sequence decodes like any other; the prompt's
        full pages join the prefix cache. Raises InvalidRequest (changing nothing) for a token
        outside the vocabulary, logprobs missing or malformed, or too few pages. With n > 1 the
        other choices fork here (``_fork``): the prompt's KV is all in."""
        if not 0 <= first_token < self.spec.vocab_size:
            raise InvalidRequest(f"first token {first_token} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        self._one_worker_only(req)
        first_lp = None
        if req.sampling.logprobs is not None:
            first_lp = TokenLogprob.from_bytes(first_logprobs, req.sampling.logprobs, self.spec.vocab_size)
        elif first_logprobs:
            raise InvalidRequest("logprobs arrived for a request that asked for none")
        if len(pages) * self.layout.page_size < len(req.prompt_ids):
            raise InvalidRequest(f"{len(pages)} pages cannot hold a prompt of {len(req.prompt_ids)} tokens")
        seq = self._new_sequence(req, room_owned=True)
        children = self._children(req, seq) if req.sampling.n > 1 else []
        if seq.grammar is not None:  # the state is rebuilt from the tokens so far: the first
            try:
                seq.grammar.advance(first_token)
            except GrammarError as exc:
                raise InvalidRequest(f"first token {first_token}: {exc}") from None
        seq.pages, seq.indexed = list(pages), cached_pages
        seq.num_computed = len(req.prompt_ids)
        seq.cached_tokens = cached_pages * self.layout.page_size
        self.scheduler.index_computed(seq)
        seq.token_ids.append(first_token)
        self._check_finish(seq, first_token)
        self._seqs[req.rid] = seq
        self._choices(req)
        out = self._delta(seq, first_token, first_lp)
        if seq.finish_reason is None:
            self.scheduler.add(seq)
        else:
            self._seqs.pop(req.rid)
            self.scheduler.detach(seq)
        if children:
            self._fork(req.rid, children, seq)
        return seq, [out]

    def start_prefill(self, req: GenerateRequest, pages: list[int], room: int, cached_pages: int = 0) -> Sequence:
        """Decode worker: run the prompt here, into ``pages`` (the room's: the first
        ``cached_pages`` from this worker's prefix cache, the rest to be computed), then generate —
        the same steps as a request on a colocated worker once its pages are in hand. The
        pages belong to ``room``. Raises InvalidRequest (changing nothing) for too few pages."""
        if len(pages) * self.layout.page_size < len(req.prompt_ids):
            raise InvalidRequest(f"{len(pages)} pages cannot hold a prompt of {len(req.prompt_ids)} tokens")
        if cached_pages and req.sampling.prompt_logprobs is not None:
            raise InvalidRequest("the prompt's logprobs need every prompt token computed, none from the cache")
        def setup(seq: Sequence) -> None:
            seq.pages, seq.indexed = list(pages), cached_pages
            seq.num_computed = seq.cached_tokens = cached_pages * self.layout.page_size

        if req.continuation is not None:
            return self._continued(req, room, setup)
        seq = self._new_sequence(req, room_owned=True, room=room)
        setup(seq)
        self._seqs[req.rid] = seq
        self._choices(req)
        self.scheduler.add(seq)
        return seq

    @staticmethod
    def _one_worker_only(req: GenerateRequest) -> None:
        """Refuse on a split what must run on one worker: the prompt's logprobs (prefill's answer
        never reaches the client) and ``max_tokens`` 0 (prefill always samples a first token)."""
        if req.sampling.prompt_logprobs is not None:
            raise InvalidRequest("the prompt's logprobs are computed on one worker, not split", param="echo")
        if req.sampling.max_tokens == 0:
            raise InvalidRequest("max_tokens 0 runs on one worker, not split", param="max_tokens")

    def _new_sequence(self, req: GenerateRequest, room_owned: bool, prefill_only: bool = False,
                      room: Optional[int] = None) -> Sequence:
        """``room_owned``: the pages belong to the request's bootstrap room (disaggregated roles),
        or to ``room`` when given; a colocated worker ignores bootstrap fields."""
        if req.rid in self._seqs or req.rid in self._open:
            raise InvalidRequest(f"request id {req.rid!r} is already running", param="rid")
        if not req.prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        self.check_fits(req, prompt_only=prefill_only)
        seed = req.sampling.seed if req.sampling.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(rid=req.rid, token_ids=list(req.prompt_ids), num_prompt_tokens=len(req.prompt_ids),
                       cache_salt=req.cache_salt, salt_key=salt_key(req.cache_salt),
                       sampling=req.sampling, seed=seed,
                       room=room if room is not None else
                       req.bootstrap.room if room_owned and req.bootstrap is not None else None)
        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, req.sampling.stop, req.stop_matcher)
        if req.sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has none
        if req.grammar is not None:
            seq.grammar = req.grammar.state()
        return seq

    def live_sequences(self) -> list[Sequence]:
        return list(self._seqs.values())

    def sequence(self, rid: str) -> Optional[Sequence]:
        """The request's live sequence (with n > 1: its first live choice)."""
        seq = self._seqs.get(rid)
        if seq is None and rid in self._forks:
            seq = next(iter(self._members(rid)), None)
        return seq

    def _members(self, rid: str) -> list[Sequence]:
        """Every live sequence of request ``rid``: its first choice and the ones forked from it."""
        first = self._seqs.get(rid)  # keyed by the request's id: choice 0, or a continuation's first
        members = [first] if first is not None and first.request_rid is None else []
        return members + [s for s in self._forks.get(rid, ()) if self._seqs.get(s.rid) is s]

    def cancel(self, rid: str) -> Optional[Sequence]:
        """Drop a request from every queue without a client answer (its room answers), every one of
        its choices; returns its first sequence, whose pages — if it belongs to a room — stay until
        ``release`` (the other choices' are their own: freed here)."""
        members = self._members(rid)
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self.scheduler.finish(seq)
        for other in members:
            if other is not seq:
                self._seqs.pop(other.rid, None)
                self.scheduler.finish(other)
        self._open.pop(rid, None)
        self._forks.pop(rid, None)
        self._requests.pop(rid, None)
        return seq

    def runs(self, seq: Sequence) -> bool:
        """Whether ``seq`` is one of this engine's sequences now (waiting, running or preempted)."""
        return self._seqs.get(seq.rid) is seq

    def release(self, seq: Sequence) -> None:
        """Free the pages a room's sequence holds, exactly once."""
        self.scheduler.release(seq)

    def abort(self, rid: str, ending: Ending = Ending(Reason.CLIENT_ABORT)) -> Optional[RequestOutput]:
        """End a request with ``ending`` (every one of its choices); a no-op (None) if it is
        unknown or already over."""
        seq = self._seqs.get(rid)
        if seq is not None and seq.request_rid is not None:  # a choice's key: its whole request
            rid = seq.request_rid
        members = self._members(rid)
        self._open.pop(rid, None)
        self._forks.pop(rid, None)
        self._requests.pop(rid, None)
        if not members:
            return None
        for seq in members:
            self._seqs.pop(seq.rid, None)
            self.scheduler.finish(seq)
        tokens = sum(s.num_output_tokens for s in members)
        log.info("request %s ended after %d tokens: %s", rid, tokens, ending)
        return RequestOutput.ended(rid, ending, prompt_tokens=members[0].num_prompt_tokens, completion_tokens=tokens)

    def abort_all(self, ending: Ending) -> list[RequestOutput]:
        return [out for rid in list(self._seqs) if (out := self.abort(rid, ending))]

    def sequences(self) -> Mapping[str, Sequence]:
        """Every live sequence by its key, read-only (the engine's thread only)."""
        return MappingProxyType(self._seqs)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        a = self.allocator
        return EngineStats(pages_free=a.num_free, pages_total=a.num_pages, pages_cached=a.num_cached,
                           pages_owned=a.num_owned, waiting=len(self.scheduler.waiting),
                           running=len(self.scheduler.running), preemptions=self.scheduler.num_preemptions,
                           cache_hit_tokens=self.scheduler.cache_hit_tokens,
                           prompt_tokens_computed=self.prompt_tokens_computed, cache_evictions=a.evictions,
                           unschedulable_steps=self.unschedulable_steps)

    def flush_cache(self) -> int:
        """Drop every cached page no one owns (engine loop only); how many."""
        return self.allocator.flush()

    # -- stepping -----------------------------------------------------------------------------

    def step(self, prompt_budget: Optional[int] = None) -> StepReport:
        """One forward pass over the scheduler's batch (``prompt_budget``: ``Scheduler.schedule``'s)."""
        batch = self.scheduler.schedule(prompt_budget)
        report = StepReport(admitted=list(self.scheduler.admitted), preempted=list(self.scheduler.preempted),
                            scheduled=len(batch), decoding=sum(1 for item in batch if item.seq.decoding))
        if not batch:
            self.unschedulable_steps += 1
            return report
        every = [i for i, item in enumerate(batch) if item.seq.wants_prompt_logprobs]
        try:
            logits = self.runner.run(batch, every) if every else self.runner.run(batch)
        except Exception as exc:  # a failed forward fails the requests in it, not the worker
            log.exception("forward pass failed; failing %d requests", len(batch))
            ending = Ending(Reason.INTERNAL_ERROR, f"the forward pass failed: {type(exc).__name__}: {exc}")
            report.failed = [(item.seq, out) for item in batch if (out := self.abort(item.seq.rid, ending))]
            return report
        self._advance(batch, logits, report, every)
        return report

    def _prompt_logprobs(self, batch: list[ScheduledSeq], logits: torch.Tensor, every: list[int],
                         report: StepReport) -> None:
        """Record the logprobs of the prompt tokens this step's rows predict, for the sequences in
        ``every`` (their rows follow the sampling rows, before their ``num_computed`` moves); a
        failure fails that request alone."""
        at = sum(1 for item in batch if item.samples)
        for i in every:
            seq, n = batch[i].seq, batch[i].num_tokens
            rows, at = logits[at:at + n], at + n
            try:
                start = seq.num_computed
                picked = [j for j in range(n) if len(seq.prompt_logprobs) <= start + j + 1 < seq.num_prompt_tokens]
                if picked:
                    k = seq.sampling.prompt_logprobs
                    targets = [seq.token_ids[start + j + 1] for j in picked]
                    seq.prompt_logprobs += token_logprobs(rows[picked], targets, [k] * len(picked))
            except Exception as exc:
                log.exception("request %s: its prompt's logprobs failed; failing that request alone", seq.rid)
                ending = Ending(Reason.INTERNAL_ERROR, f"the prompt's logprobs failed: {type(exc).__name__}: {exc}")
                if (out := self.abort(seq.rid, ending)) is not None:
                    report.failed.append((seq, out))

    def _advance(self, batch: list[ScheduledSeq], logits: torch.Tensor, report: StepReport,
                 every: list[int] = ()) -> None:
        """Account the batch's computed tokens, then sample and check each sampling sequence's
        token. What is done with one sequence's own data (its sampling parameters, its stop
        strings, its text) is done for it alone: an exception there fails that request
        (``report.failed``), never the batch."""
        sampling = [item for item in batch if item.samples]  # row i of logits is sampling[i]'s
        gone: set[int] = set()
        if every:
            self._prompt_logprobs(batch, logits, every, report)
            logits = logits[:len(sampling)]
            gone = {id(seq) for seq, _ in report.failed}  # their requests ended: nothing more is done
        self._account(batch, gone, report)
        if not sampling:  # only prompt chunks ran: nothing to sample
            return
        adjusted, greedy = self._adjusted(logits, sampling)
        for row, item in enumerate(sampling):
            seq = item.seq
            if id(seq) in gone:
                continue
            if seq.sampling.max_tokens == 0 or seq.finish_reason is not None:  # the prompt alone was
                seq.finish_reason = seq.finish_reason or "length"  # asked for, or a continuation's ids end it
                report.sampled.append((seq, self._delta(seq, None)))
                self._seqs.pop(seq.rid, None)
                self.scheduler.finish(seq)
                continue
            sampled, delta = self._sample_row(seq, row, logits, adjusted, greedy, report)
            if sampled:
                self._after_token(seq, delta, report)

    def _account(self, batch: list[ScheduledSeq], gone: set[int], report: StepReport) -> None:
        """The tokens each sequence computed this step (prompt chunks reported as such)."""
        for item in batch:
            seq = item.seq
            if id(seq) in gone:
                continue
            self.prompt_tokens_computed += max(0, min(seq.num_computed + item.num_tokens, seq.num_prompt_tokens)
                                               - seq.num_computed)
            seq.num_computed += item.num_tokens
            self.scheduler.index_computed(seq)
            if not item.samples:
                report.chunks.append(seq)

    @staticmethod
    def _adjusted(logits: torch.Tensor, sampling: list[ScheduledSeq]):
        """(the logits penalties and biases adjusted, or None when that failed: each row then
        adjusts alone; the greedy tokens of the adjusted rows, or None when none is greedy).
        Penalties and biases change what is sampled from, never the logprobs (the raw logits')."""
        try:
            adjusted = adjust_logits(logits, [i.seq.sampling for i in sampling], [i.seq.token_ids for i in sampling],
                                     [i.seq.num_prompt_tokens for i in sampling])
        except Exception:  # a bug in one row's parameters must not end the loop: each fails alone below
            log.exception("penalties failed for a batch of %d; adjusting row by row", len(sampling))
            return None, None
        return adjusted, greedy_tokens(adjusted) if any(i.seq.sampling.greedy for i in sampling) else None

    def _sample_row(self, seq: Sequence, row: int, logits: torch.Tensor, adjusted, greedy,
                    report: StepReport) -> tuple[bool, Optional[RequestOutput]]:
        """Sample and check ``seq``'s token from row ``row``: (whether it did, its delta). A failure
        fails ``seq``'s request alone (``report.failed``): a grammar past its limit as the client's
        bad request, anything else as an internal error."""
        delta = None
        try:
            if adjusted is None:  # this row's own adjustment, failing this request alone
                own = adjust_logits(logits[row:row + 1], [seq.sampling], [seq.token_ids], [seq.num_prompt_tokens])
                token = self._sample(own, 0, seq, None if not seq.sampling.greedy else greedy_tokens(own))
            else:
                token = self._sample(adjusted, row, seq, greedy)
            lp = None
            if seq.sampling.logprobs is not None:
                lp = token_logprobs(logits[row:row + 1], [token], [seq.sampling.logprobs])[0]
            seq.token_ids.append(token)
            if seq.prefill_only:
                seq.first_logprob = lp  # travels to decode with the first token
            else:
                self._check_finish(seq, token)
                delta = self._delta(seq, token, lp)
        except GrammarError as exc:  # the client's grammar hit a limit: its own bad request, named
            self._fail(seq, Ending(Reason.BAD_REQUEST, str(exc)), report)
            return False, None
        except Exception as exc:
            log.exception("request %s: sampling or checking its token failed; failing that request alone", seq.rid)
            self._fail(seq, Ending(Reason.INTERNAL_ERROR, f"sampling or checking a token failed: "
                                   f"{type(exc).__name__}: {exc}"), report)
            return False, None
        return True, delta

    def _fail(self, seq: Sequence, ending: Ending, report: StepReport) -> None:
        if (out := self.abort(seq.rid, ending)) is not None:
            report.failed.append((seq, out))

    def _after_token(self, seq: Sequence, delta: Optional[RequestOutput], report: StepReport) -> None:
        """``seq`` has its new token: a prefill's first token leaves for its transfer; else its
        delta is reported, a finished sequence leaves, and a request's first choice forks the rest."""
        if seq.prefill_only:  # the first token is the room's; the sequence waits for its transfer
            self._seqs.pop(seq.rid, None)
            self.scheduler.detach(seq)
            report.first_tokens.append(seq)
            return
        report.sampled.append((seq, delta))
        if seq.finish_reason is not None:
            self._seqs.pop(seq.rid, None)
            self.scheduler.finish(seq)
        if seq.out_rid in self._requests and seq.choice == 0:
            try:
                self._fork(seq.rid, self._children(self._requests[seq.rid], seq), seq)
            except Exception as exc:
                log.exception("request %s: its choices could not fork; failing the request", seq.rid)
                report.sampled = [(s, d) for s, d in report.sampled if s.out_rid != seq.rid]
                self._fail(seq, Ending(Reason.INTERNAL_ERROR, f"forking its choices failed: {type(exc).__name__}: "
                                       f"{exc}"), report)

    def _children(self, req: GenerateRequest, first: Sequence) -> list[Sequence]:
        """Choices 1..n-1 of a request with n > 1, built (nothing changes yet; it may raise, e.g.
        a grammar's state). Each is a sequence of the prompt alone, with its own seed
        (``choice_seed``: seeded choices differ) and its own grammar state."""
        p = first.sampling
        children = []
        for i in range(1, p.n):
            child = Sequence(rid=f"{req.rid}{CHOICE_KEY}{i}", token_ids=list(req.prompt_ids),
                             num_prompt_tokens=len(req.prompt_ids), sampling=p, seed=choice_seed(first.seed, i),
                             cache_salt=req.cache_salt, salt_key=first.salt_key, choice=i, request_rid=req.rid)
            child.detok = IncrementalDetokenizer(self.tokenizer, child.token_ids, p.stop, req.stop_matcher)
            child.prompt_logprobs = list(first.prompt_logprobs)  # all in: it may take the cache's pages
            if req.grammar is not None:
                child.grammar = req.grammar.state()
            children.append(child)
        return children

    def _fork(self, rid: str, children: list[Sequence], first: Sequence) -> None:
        """Choice 0 of request ``rid`` has its first token, so the prompt's KV is computed (its
        full pages in the prefix cache): the other choices start. Each takes the prompt's full
        pages from the prefix cache (shared, read-only), computes the partial last page (its own)
        and samples its first token from there, as any sequence does; its pages are its own to
        free. They queue in ``first``'s place, under its promise (``scheduler.py``)."""
        self._requests.pop(rid)
        for child in children:
            self._forks[rid].append(child)
            self._seqs[child.rid] = child
            self.scheduler.add(child, request=first)

    def _sample(self, logits: torch.Tensor, row: int, seq: Sequence, greedy: Optional[list]) -> int:
        if seq.grammar is not None:  # only what the grammar allows, then the grammar takes it
            masked = seq.grammar.mask(logits[row])
            if seq.sampling.greedy:
                token = greedy_tokens(masked[None])[0]
                if token is None:
                    raise NoFiniteLogits("the grammar allows no token the model gives a finite logit")
            else:
                token = sample_token(masked, seq.sampling, seq.seed, len(seq))
            seq.grammar.advance(token)
            return token
        if not seq.sampling.greedy:
            return sample_token(logits[row], seq.sampling, seq.seed, len(seq))
        if greedy[row] is None:
            raise NoFiniteLogits("the model gave no finite logit for this token")
        return greedy[row]

    def _check_finish(self, seq: Sequence, token: int, replayed: bool = False) -> None:
        """Set ``seq.finish_reason`` if ``token`` ends it; ``replayed``: a continuation's given token,
        whose text the client has (released here as it was when generated, and dropped)."""
        p = seq.sampling
        if not p.ignore_eos and token in self._eos:
            seq.finish_reason = "stop"
            return
        if token in p.stop_token_ids:
            seq.finish_reason = "stop"
            return
        if replayed:
            replay(seq.detok, [token])
        else:
            seq.detok.add(token)
        if seq.detok.stopped or (seq.grammar is not None and seq.grammar.done):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.spec.max_context:
            seq.finish_reason = "length"

    def _delta(self, seq: Sequence, token: Optional[int], logprob: Optional[TokenLogprob] = None) -> RequestOutput:
        """The client's delta of ``token`` (None: the request ends with no token); the first one
        carries the prompt's logprobs when the request asked for them."""
        finished = seq.finish_reason is not None
        if finished and seq.out_rid in self._open:  # n > 1: the request ends with its last choice
            self._open[seq.out_rid] -= 1
            finished = self._open[seq.out_rid] == 0
            if finished:
                del self._open[seq.out_rid]
                self._forks.pop(seq.out_rid, None)
        first = seq.num_output_tokens <= 1 and seq.sampling.prompt_logprobs is not None
        return RequestOutput(rid=seq.out_rid, index=seq.choice, token_ids=(token,) if token is not None else (),
                             text=seq.detok.release(final=seq.finish_reason is not None),  # its own end
                             finished=finished, finish_reason=seq.finish_reason,
                             prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
                             logprobs=(logprob,) if logprob is not None else (),
                             prompt_logprobs=tuple(seq.prompt_logprobs) if first else ())

    # -- offline use --------------------------------------------------------------------------

    def generate(self, requests: list[GenerateRequest]) -> dict[str, RequestOutput]:
        """Run requests to completion; returns each one's whole answer as one RequestOutput."""
        for req in requests:
            self.add_request(req)
        acc: dict[str, list[RequestOutput]] = {r.rid: [] for r in requests}
        while self.has_work():
            for out in self.step().outputs:
                acc[out.rid].append(out)
        return {rid: merge_outputs(outs) for rid, outs in acc.items()}


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    last = outs[-1]
    return RequestOutput(rid=last.rid, token_ids=tuple(t for o in outs for t in o.token_ids),
                         text="".join(o.text for o in outs), finished=last.finished,
                         finish_reason=last.finish_reason, error=last.error, reason=last.reason,
                         prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                         logprobs=tuple(lp for o in outs for lp in o.logprobs),
                         prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs), ()))
