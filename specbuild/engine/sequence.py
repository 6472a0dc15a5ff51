"""Request, per-sequence state and the stream handle a front end reads."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from specbuild.sampling.params import SamplingParams
from specbuild.speculation.state import SpecState
from specbuild.engine.text import IncrementalDetokenizer, StopStringFilter

_ids = itertools.count(1)


@dataclass
class Request:
    """What a front end submits. Either `prompt_ids` or `prompt` (text) is required."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: Any = None  # SpeculationConfig (None: the bundle's default)
    request_id: str | None = None
    response_format: Any = None  # structured output: an OpenAI response_format dict or a ResponseFormat
    logprobs: int | None = None  # None: none; N >= 0: each token's logprob and the N most likely
    # None: none; N >= 0: each prompt token's logprob (from the second on) and the N most likely,
    # computed by the request's own prefill (completions' echo + logprobs)
    prompt_logprobs: int | None = None
    shares_prompt_with: Any = None  # a Handle with the same prompt (n > 1 choices): its prefill is reused
    content_type: str | None = None  # code | structured | summarization | chat | ...; None: classified
    # mixed into the prefix cache's hashes: prompts with different salts never share K/V, so one
    # tenant cannot learn from timing whether another sent a prefix (vLLM's cache_salt)
    cache_salt: str | None = None


@dataclass
class Event:
    """One streamed increment. `text` may be empty while a character is incomplete."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list | None = None  # per token (request.logprobs set): (logprob, [(id, logprob), ...])


class Sequence:
    """Scheduler state of one request: its token state, with its parts: the output's text and
    what ends it (`ending`, an Ending), its logprobs (`scoring`, a Scoring), what was decided
    as it came in (`admission`, an Admission), its statistics (`tally`, a SeqStats), the
    speculator's state (`spec_state`) and its `handle`. Owned by the step loop's thread. Each
    field has one writer (tests/engine/test_sequence_record.py): these methods, the part's own
    methods, or the one module that owns it (the engine what it decides at submit, the
    scheduler the KV budget and the prompt source)."""

    def __init__(self, request: Request, prompt_ids: list[int], params: SamplingParams, spec, tokenizer,
                 eos_ids: tuple[int, ...], max_total_len: int, prefill_source: Sequence | None = None) -> None:
        self.seq_id = next(_ids)
        self.request = request
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params  # seeded
        self.spec = spec
        self.generator = torch.Generator().manual_seed(params.seed)
        self.num_cached = 0  # tokens of all_ids whose K/V are in the target cache (set_cached)
        self.finish_reason: str | None = None  # set when it ends (finished): stop | length | abort | error
        self.ending = Ending(tokenizer, params, eos_ids, max_total_len)  # its text and what ends it
        self.scoring = Scoring()  # its logprobs (the step's), written by Scoring's methods only
        self.admission = Admission(prefill_source)  # what the engine and the scheduler decided for it
        self.tally = SeqStats()  # its statistics: written by SeqStats' own methods only
        self.spec_state = SpecState()  # the speculator's and drafters' state (speculation/state.py)
        self.handle: Handle | None = None

    @property
    def text(self) -> str:
        """The output's text so far (`ending.text`)."""
        return self.ending.text

    @property
    def content_type(self) -> str | None:
        """The request's content type (`admission.content_type`): its own, or classified."""
        return self.admission.content_type

    @property
    def constraint(self):
        """The grammar constraint of a structured-output request (`admission.constraint`), or None."""
        return self.admission.constraint

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still generate: its max_tokens and the context limit."""
        return min(self.params.max_tokens - len(self.output_ids), self.ending.max_total_len - self.total_len)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    def uniforms(self, n: int) -> torch.Tensor:
        """n uniforms in [0, 1) from this request's own generator: [n] float64."""
        return torch.rand(n, generator=self.generator, dtype=torch.float64)

    def append_tokens(self, tokens: list[int]) -> list[int]:
        """Append sampled tokens one by one, stopping at EOS / stop string / limits.

        Returns the tokens actually kept (a stop inside a multi-token acceptance cuts there).
        """
        kept: list[int] = []
        now = time.perf_counter()
        ending, constraint = self.ending, self.admission.constraint
        for tok in tokens:
            self.output_ids.append(tok)
            kept.append(tok)
            if tok in ending.eos_ids:
                self._finish("stop")
                break
            if constraint is not None:
                constraint.advance(tok)
            if ending.push(tok):  # a stop string
                self._finish("stop")
                break
            if constraint is not None and constraint.finished:  # the grammar is complete
                self._finish("stop")
                break
            if len(self.output_ids) >= self.params.max_tokens or self.total_len >= ending.max_total_len:
                self._finish("length")
                break
        self.tally.on_tokens(len(kept), now)
        return kept

    def fail(self, message: str, status: int = 500) -> None:
        """End the request with an error its handle reports (finish reason "error"): the
        message names the cause; status is what a front end answers, 400 when the request's
        own values caused it (its grammar hit the grammar engine's limits, ...), 500 when the
        engine did. A request that already ended keeps its result (no second final event)."""
        if self.handle is not None and self.handle.done.is_set():
            return
        self.finish_reason = "error"
        if self.handle:
            self.handle.error = message
            self.handle.error_status = status
            self.handle._emit(Event([], "", True, "error"))

    def abort(self) -> None:
        """End the request as aborted (finish reason "abort") and tell its handle; a request
        that already ended keeps its result."""
        if self.finished:
            return
        self.finish_reason = "abort"
        if self.handle is not None:
            self.handle._emit(Event([], "", True, "abort"))

    def set_cached(self, length: int) -> None:
        """The target's cache holds `length` tokens of all_ids: the one writer of num_cached
        (a step's commit, a prefix adopted, a shared prompt copied, a repair's 0)."""
        self.num_cached = length

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.ending.flush()

    def stats(self) -> dict[str, Any]:
        t = self.tally
        gen = len(self.output_ids)
        t_end = t.t_last or time.perf_counter()
        t0 = t.t_admit or t.t_submit
        dur = max(t_end - t0, 1e-9)
        tpot = ((t.t_last - t.t_first) / (gen - 1) * 1e3) if gen > 1 and t.t_first else 0.0
        passes = max(t.verify_passes, 1)
        return {
            "seed": self.params.seed,
            "prompt_tokens": len(self.prompt_ids),
            "cached_tokens": t.cached_tokens,
            "generated_tokens": gen,
            "target_passes": t.target_passes,
            "ttft_ms": round(((t.t_first or t_end) - t.t_submit) * 1e3, 3),
            "tpot_ms": round(tpot, 3),
            "tokens_per_s": round(gen / dur, 3),
            "drafted": t.drafted,
            "accepted": t.accepted,
            "mean_accepted_tokens": round((t.accepted + t.verify_passes) / passes, 4)
            if t.verify_passes else 1.0,
            "acceptance_by_position": [round(a / d, 4) if d else None
                                       for a, d in zip(t.accepted_by_pos, t.drafted_by_pos)],
            "gamma": gamma_summary(t.gammas),
            **({"grammar_mask_ms": round(self.constraint.mask_seconds * 1e3, 3), "grammar_masked_rows":
                self.constraint.masks} if self.constraint is not None else {}),
            **t.extra,
            "content_type": self.content_type,
        }


class Ending:
    """A sequence's output text and what ends the output (`seq.ending`): the stop token ids
    (EOS and the request's stop_token_ids, none under ignore_eos), the context limit, the
    incremental detokenizer and the stop-string filter. Only `push` and `flush` write `text`;
    the other fields are set here once. `Sequence.append_tokens` asks it, with the grammar
    and max_tokens, whether the output ends."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: tuple[int, ...], max_total_len: int) -> None:
        self.eos_ids = () if params.ignore_eos else tuple(eos_ids) + tuple(params.stop_token_ids)
        self.max_total_len = max_total_len  # prompt + output tokens at most (the context)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop_filter = StopStringFilter(params.stop)
        self.text = ""

    def push(self, tok: int) -> bool:
        """Append the text of one output token (what the stop filter lets through); True when
        a stop string ended the output."""
        self.text += self.stop_filter.push(self.detok.push([tok]))
        return self.stop_filter.stopped

    def flush(self) -> None:
        """The output ended: the detokenizer's and the stop filter's held-back text (none after
        a stop string)."""
        if not self.stop_filter.stopped:
            self.text += self.stop_filter.push(self.detok.flush())
            self.text += self.stop_filter.flush()


class Scoring:
    """A sequence's logprobs (`seq.scoring`), kept when its request asks for them; only these
    methods write its fields (the step calls them, the scheduler's share_prefills copies a
    prompt source's)."""

    def __init__(self) -> None:
        self.logprobs: list = []  # per output token (request.logprobs): (logprob, [(id, logprob), ...])
        self.prompt_logprobs: list = []  # prompt tokens 1.. (request.prompt_logprobs), as logprobs
        self.prompt_scored = 0  # prompt positions whose next-token logprob is in prompt_logprobs

    def add(self, logprobs: list) -> None:
        """The logprobs of the output tokens just kept."""
        self.logprobs += logprobs

    def score_prompt(self, logprobs: list, upto: int) -> None:
        """Prompt logprobs of the positions before `upto` (prompt_logprobs): the step's, or its
        prompt source's (share_prefills) when it copies them."""
        self.prompt_logprobs += logprobs
        self.prompt_scored = upto


class Admission:
    """What was decided for a sequence as it came in (`seq.admission`), each field by one
    owner: at submit the engine (Engine._new_sequence, assign_content_type) its grammar
    constraint, content type and gamma policy; at admission the scheduler its KV budget, and
    whether it copies a running sequence's prompt (share_prefills clears `prefill_source`)."""

    def __init__(self, prefill_source: Sequence | None = None) -> None:
        self.constraint = None  # sampling.constraint.Constraint when the request asks for structured output
        self.content_type: str | None = None  # the request's, or classified (Engine.assign_content_type)
        self.content_type_source: str | None = None  # request | classifier
        self.gamma_policy = None  # speculation.policy.GammaPolicy the controller starts from, or None
        # a running Sequence whose prompt K/V this one copies (the scheduler's share_prefills clears it)
        self.prefill_source = prefill_source
        self.budget_blocks = 0  # KV blocks the scheduler promised this sequence at admission


class SeqStats:
    """A sequence's statistics (`seq.tally`; `Sequence.stats()` reports them). Only these
    methods write its fields: the step and the TensorRT-LLM backends hand `on_pass` each
    target pass's Verdict, the scheduler notes admission, prefix hits and repairs."""

    def __init__(self) -> None:
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None  # the first output token
        self.t_last: float | None = None  # the latest output tokens
        self.target_passes = 0  # target passes that ran this sequence (prefill chunks included)
        self.verify_passes = 0  # decode passes (each yields accepted + 1 tokens)
        self.drafted = 0  # draft tokens verified (a tree's: its nodes)
        self.accepted = 0
        self.drafted_by_pos: list[int] = []  # per draft position (a tree's depth): drafts verified
        self.accepted_by_pos: list[int] = []  # ... and those accepted
        self.gammas: list[int] = []  # the depth planned at each decode pass that planned one
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache (usage's cached_tokens)
        self.repairs = 0  # times its target cache was found inconsistent and re-prefilled
        self.extra: dict[str, Any] = {}  # backend-specific result stats, under their output names

    def on_pass(self, verdict) -> None:
        """One target pass over the sequence, as its Verdict (speculation/speculator.py) counts
        it: a decode pass (verify_pass), the depth planned for it (gamma), drafts verified and
        accepted, and the drafts per position (depth_counts)."""
        self.target_passes += 1
        if verdict.verify_pass:
            self.verify_passes += 1
        if verdict.gamma is not None:
            self.gammas.append(verdict.gamma)
        self.drafted += verdict.drafted
        self.accepted += verdict.accepted
        for i, c in enumerate(verdict.depth_counts):
            if len(self.drafted_by_pos) <= i:
                self.drafted_by_pos.append(0)
                self.accepted_by_pos.append(0)
            self.drafted_by_pos[i] += c
            self.accepted_by_pos[i] += int(i < verdict.accepted)

    def on_tokens(self, n: int, now: float) -> None:
        """`n` tokens appended at `now` (0: a stop ended the append before any was kept)."""
        if n and self.t_first is None:
            self.t_first = now
        self.t_last = now

    def on_admit(self) -> None:
        self.t_admit = time.perf_counter()

    def on_prefix_hit(self, n: int) -> None:
        self.cached_tokens += n

    def on_repair(self) -> None:
        self.repairs += 1

    def note(self, name: str, value: Any) -> None:
        """A backend's own result stat (output name `stat_...`)."""
        self.extra[name] = value


def gamma_summary(gammas: list[int]) -> dict[str, Any]:
    if not gammas:
        return {"mean": 0.0, "min": 0, "max": 0, "steps": 0}
    return {"mean": round(sum(gammas) / len(gammas), 3), "min": min(gammas), "max": max(gammas),
            "steps": len(gammas)}


class Handle:
    """A submitted request: stream its events, or wait for the result.

    Without a background loop, iterating drives the engine's step loop itself.
    """

    def __init__(self, engine, seq: Sequence) -> None:
        self._engine = engine
        self.seq = seq
        self.request_id = seq.request.request_id or f"req-{seq.seq_id}"
        self._events: queue.Queue[Event] = queue.Queue()
        self.done = threading.Event()
        self.error: str | None = None
        self.error_status = 500  # with `error`: 400 when the request's own values caused it (Sequence.fail)
        # called (on the engine's thread) after each event is queued: lets an asyncio front
        # end wake its waiter with loop.call_soon_threadsafe instead of blocking on get()
        self.listener: Callable[[], None] | None = None

    def _emit(self, event: Event) -> None:
        self._events.put(event)
        if event.finished:
            self.done.set()
        listener = self.listener
        if listener is not None:
            wake = getattr(self._engine, "wake_listener", None)
            if wake is not None:
                wake(listener)  # held back to the step's forward on the loop thread (BaseEngine.wake_listener)
            else:
                listener()

    def get_nowait(self) -> Event | None:
        """The next queued event, or None when none is queued (never waits)."""
        try:
            return self._events.get_nowait()
        except queue.Empty:
            return None

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, waiting up to `timeout` seconds (None: forever); None on timeout.
        For front ends whose engine runs in the background (servers)."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _drained(self) -> bool:
        return self.done.is_set() and self._events.empty()

    def __iter__(self) -> Iterator[Event]:
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                if self.done.is_set():  # finished and fully consumed already
                    return
                if self._engine.background:
                    ev = self._events.get()
                else:
                    self._engine.step()
                    continue
            yield ev
            if ev.finished:
                return

    def result(self) -> dict[str, Any]:
        """Drive (or wait) to completion and return text, token_ids, finish_reason, stats."""
        for _ in self:
            pass
        s = self.seq
        return {"text": s.text, "token_ids": list(s.output_ids), "finish_reason": s.finish_reason,
                "stats": s.stats(),
                **({"logprobs": logprob_records(s.scoring.logprobs)} if s.request.logprobs is not None else {}),
                **({"error": self.error, "error_status": self.error_status} if self.error else {})}


def logprob_records(items: list) -> list[dict[str, Any]]:
    """(logprob, [(id, logprob), ...]) per token -> JSON-ready records (-inf becomes None)."""
    def num(x: float):
        return None if x == float("-inf") else round(x, 6)
    return [{"logprob": num(lp), "top_logprobs": [{"id": i, "logprob": num(v)} for i, v in top]}
            for lp, top in items]
