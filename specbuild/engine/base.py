"""What every serving engine shares, whichever backend runs the model: the bundle's text
helpers, the request queue (`waiting`, `running`), submit's validation and hand-off, the
background loop and the load figures front ends read.

Two subclasses: the torch `engine.Engine` (its `Scheduler` plans over these same two
collections) and `backends.tensorrt_llm.TrtllmEngine` (TensorRT-LLM's executor). It lives
in engine/, not backends/, because train/ and bench/ drive the torch Engine directly and
sit below backends/ in the import chain.

A subclass sets, in its __init__: bundle_dir, config, meta (BundleMeta), tokenizer,
target_config, eos_ids, max_seq_len, max_batch_size, default_sampling, default_speculation,
calls `_init_loop(lock)` before anything reads the queue, sets `load_seconds`; and implements `_new_sequence(request)` (validate, or
raise RequestError with nothing queued), `step()`, `abort(handle)` and
`_fail_running(message)` (called with the lock held when a step raised). The torch
scheduler isolates failures itself (engine/scheduler.py: one request's failure is that
request's alone); what reaches `_loop` is a failure outside any step's batch.
"""

from __future__ import annotations

import collections
import logging
import threading

from specbuild.errors import RequestError
from specbuild.engine.sequence import Handle, Request, Sequence

log = logging.getLogger("specbuild.engine")

GC_GEN0 = 20_000  # allocations between young-generation collections in a serving process (Python: 700)


def quiet_gc() -> bool:
    """Keep Python's cyclic garbage collector out of the decode steps of a process that serves.

    A loaded engine holds ~300,000 objects the collector tracks (torch, the tokenizer, the
    bundle); each step allocates a few hundred more. With Python's defaults a young collection
    ran every ~700 allocations and an older one every ten of those, walking the survivors: 7%
    of a one-row decode loop's samples under perf on an AMD EPYC (1 thread). Here the objects alive after loading are collected once
    and frozen (gc.freeze: never walked again, still freed by reference counting), and young
    collections come every GC_GEN0 allocations. Called once the engine is loaded: by the
    background loop's start (servers, Triton, MPI ranks) and by `specbuild generate`.
    $SPECBUILD_GC=default leaves the collector as Python set it. Returns whether it changed it."""
    import gc
    import os

    if os.environ.get("SPECBUILD_GC", "") == "default":
        return False
    gc.collect()
    gc.freeze()
    g0, g1, g2 = gc.get_threshold()
    if 0 < g0 < GC_GEN0:
        gc.set_threshold(GC_GEN0, g1, g2)
    return True


def validated_prompt_ids(request: Request, encode, vocab_size: int, max_seq_len: int) -> list[int]:
    """The request's prompt as token ids, or a RequestError naming the value and the limit.
    Shared by every backend's submit()."""
    if request.prompt_ids is None:
        if request.prompt is None:
            raise RequestError("a request needs a prompt or prompt_ids")
        prompt_ids = encode(request.prompt)
    else:
        prompt_ids = [int(t) for t in request.prompt_ids]
    if not prompt_ids:
        raise RequestError("the prompt is empty (0 tokens)")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is out of range [0, {vocab_size})")
    if len(prompt_ids) >= max_seq_len:
        raise RequestError(f"prompt is {len(prompt_ids)} tokens; max_seq_len is {max_seq_len} "
                           "(the prompt plus at least one generated token must fit)")
    return prompt_ids


class BaseEngine:
    """The request queue and the background loop both backends share (see module doc)."""

    backend_name = "base"

    load_seconds = 0.0
    # hold the waiters' wakes back to the step's forward (wake_listener): only an engine whose
    # forwards call flush_wakes as their layer stack begins (the torch engine's Decoder) sets it
    defer_wakes = False

    def _init_loop(self, lock) -> None:
        """The request queue and the state of the background loop (start/_loop/stop)."""
        self.waiting: collections.deque[Sequence] = collections.deque()  # submitted, not admitted
        self.running: list[Sequence] = []  # admitted, generating (mutated in place, never replaced)
        self.background = False
        self._lock = lock
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._loop_failures = 0  # steps whose exception reached the loop (every running request failed)
        # waiters' wakes held back while the loop thread's step runs (Handle._emit -> wake_listener);
        # None: every wake is called at once
        self._wakes: list | None = None
        self._loop_ident: int | None = None  # the loop thread's ident while it runs

    # ---- waking the waiters ---------------------------------------------------------------
    def wake_listener(self, listener) -> None:
        """Call a handle's listener (its waiter's wake), or, in the loop's thread, hold it back
        until the next forward's layer stack begins (defer_wakes; flush_wakes).

        Why: the wake lets the HTTP thread run its token's work (the coroutine, JSON, the
        socket). Called mid-step, that thread takes the GIL at the next torch op of the step
        that follows and the engine waits for it: the served plain step's own Python took
        twice the main thread's (0.91 ms against 0.46, AMD EPYC). Woken as the forward begins,
        the front end runs while the layer stack holds no GIL."""
        wakes = self._wakes
        if wakes is not None and threading.get_ident() == self._loop_ident:
            wakes.append(listener)
        else:
            listener()

    def flush_wakes(self) -> None:
        """Call the wakes held back, in the loop's thread: its layer stack is about to begin
        (Decoder.before_stack), or the loop has nothing more to run."""
        wakes = self._wakes
        if wakes and threading.get_ident() == self._loop_ident:
            self._wakes = []
            for listener in wakes:
                listener()

    # ---- text helpers (need only .tokenizer and .meta) ------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        sp = self.meta.special_tokens
        bos = sp.get("bos_token_id")
        if add_special_tokens and sp.get("add_bos_token") and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from specbuild.engine.chat import render_chat

        sp = self.meta.special_tokens
        vocab_size = self.tokenizer.get_vocab_size()

        def tok(i):
            return self.tokenizer.id_to_token(i) if isinstance(i, int) and 0 <= i < vocab_size else ""

        return render_chat(sp.get("chat_template"), messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok(sp.get("bos_token_id")) or "", eos_token=tok(sp.get("eos_token_id")) or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a chat, its message text encoded as plain text: a control-token
        string inside a message never becomes a control token (engine/chat.py ChatEncoder)."""
        from specbuild.engine.chat import ChatEncoder, validate_messages

        encoder = self.__dict__.get("_chat_encoder")
        if encoder is None:
            encoder = self._chat_encoder = ChatEncoder(self.tokenizer)
        validate_messages(messages)
        return encoder.encode_rendered(self.render_chat(encoder.escape_messages(messages), add_generation_prompt))

    # ---- requests ---------------------------------------------------------------------------
    def _new_sequence(self, request: Request) -> Sequence:
        raise NotImplementedError

    def submit(self, request: Request) -> Handle:
        """Validate and queue a request. Raises RequestError (nothing queued) on bad input."""
        seq = self._new_sequence(request)
        handle = Handle(self, seq)
        seq.handle = handle
        # no engine lock here: deque appends are thread-safe, and the step loop re-takes the lock
        # the moment it releases it, so a submitter waiting for it starved behind whole runs of
        # steps (measured under MineDraft: median 0.35 s from submit to admission, 2.7 of 4
        # clients' requests running); the next step's admit() sees the request
        self.waiting.append(seq)
        self._wake.set()
        return handle

    def abort(self, handle: Handle) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        """Load figures for health checks and metrics, the same keys on every backend (None:
        this backend does not know): queue_depth (requests waiting for admission), running
        (admitted, generating), kv_blocks_used, kv_blocks_total, gamma (mean current draft
        length over running requests that speculate; 0.0 when none), step_failures (engine
        steps whose failure belonged to no single request: the requests of that step failed),
        sequence_failures (requests failed alone inside a step; their neighbours went on).
        Lock-free reads."""
        running = list(self.running)
        gammas = [s.tally.gammas[-1] for s in running if s.tally.gammas]
        used, total = self._kv_blocks()
        failures = self._failure_counts()
        return {"queue_depth": len(self.waiting), "running": len(running), "kv_blocks_used": used,
                "kv_blocks_total": total, "gamma": sum(gammas) / len(gammas) if gammas else 0.0,
                "step_failures": failures["step"], "sequence_failures": failures["sequence"],
                **self._extra_stats()}

    def _failure_counts(self) -> dict[str, int]:
        """{"step": ..., "sequence": ...} failures so far (see stats()); a backend that isolates
        sequences adds its own counts."""
        return {"step": getattr(self, "_loop_failures", 0), "sequence": 0}

    def drafter_settings(self) -> dict:
        """The drafters' settings this engine runs with, `<name>_<field>` -> value (/health);
        empty where the backend runs no specbuild drafters."""
        return {}

    def _extra_stats(self) -> dict:
        """Backend-specific load figures added to stats() (the torch engine: its telemetry sink's)."""
        return {}

    def _kv_blocks(self) -> tuple[int | None, int | None]:
        """(used, total) KV cache blocks, for stats(); (None, None) when the backend owns its cache."""
        return None, None

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> int:
        raise NotImplementedError

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run_until_done(self) -> None:
        state = self._before_run()
        try:
            while self.has_work():
                self.step()
        finally:
            self._after_run(state)

    def _before_run(self):
        """Called in the caller's thread before run_until_done steps (the torch engine saves the
        caller's thread count here); its result goes to _after_run."""
        return None

    def _after_run(self, state) -> None:
        """Called after run_until_done's steps, also when one raised."""

    def generate(self, requests: list[Request]) -> list[dict]:
        handles = [self.submit(r) for r in requests]
        self.run_until_done()
        return [h.result() for h in handles]

    def start(self) -> None:
        """Run the step loop on a background thread (servers)."""
        if self._thread is not None:
            return
        self.background = True
        self._stop = False
        quiet_gc()  # the loaded engine's objects frozen before its steps start
        self._loop_ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specbuild-engine", daemon=True)
        self._thread.start()
        # the loop's set-up (the torch engine times its threading there) before anyone is told it
        # serves: a server's /health answers, and a benchmark's next process starts, after it
        self._loop_ready.wait(timeout=120)

    def _before_loop(self) -> None:
        """Run in the loop's thread before its first step (the torch engine chooses its threading here)."""

    def _loop(self) -> None:
        try:
            self._before_loop()
        except Exception:  # a failed choice must not stop the loop: it runs with what it has
            log.exception("engine loop set-up failed; stepping anyway")
        finally:
            ready = getattr(self, "_loop_ready", None)
            if ready is not None:
                ready.set()
        if self.defer_wakes:
            self._loop_ident = threading.get_ident()
            self._wakes = []  # held back from here on (wake_listener): the steps call flush_wakes
        while not self._stop:
            if not self.has_work():
                self.flush_wakes()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                if not self.step():
                    self.flush_wakes()  # a step that ran no forward
            except Exception:  # a bug must not leave clients hanging: fail what was running
                self.flush_wakes()
                self._loop_failures += 1
                ids = [s.handle.request_id if s.handle is not None else f"seq-{s.seq_id}" for s in list(self.running)]
                log.exception("engine step failed outside any one request; failing the running requests: %s",
                              ", ".join(ids))
                with self._lock:
                    self._fail_running("internal error in the engine step (see server log)")
        self.flush_wakes()
        self._wakes = self._loop_ident = None

    def _fail_running(self, message: str) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.background = False

    def close(self) -> None:
        self.stop()
