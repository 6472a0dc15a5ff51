"""`specbuild serve BUNDLE`: the OpenAI-compatible HTTP server, on one process or two ranks.

    specbuild serve BUNDLE                                         one process
    specbuild serve BUNDLE --backend tensorrt-llm                  TensorRT-LLM's executor
    mpirun -n TP*PP specbuild serve BUNDLE                         TensorRT-LLM leader mode
    mpirun -disable-auto-cleanup -n 2 specbuild serve BUNDLE --parallel-draft

The engine comes from `runtime.backend.open_engine`, with --backend as `generate` takes it
(auto: TensorRT-LLM where the bundle's engines are built and it runs here, else torch).

Leader mode (a bundle whose TensorRT-LLM engines were built for tp*pp > 1 ranks): every rank
opens its engine; rank 0 serves HTTP and takes every request, the other ranks serve their part
of the engine (`parallel.follow_leader`, as `generate` does) until rank 0 shuts down, then
all exit 0. Launch it without -disable-auto-cleanup (a dead rank must take the job down).

With --parallel-draft, rank 0 serves HTTP and verifies, rank 1 runs the draft model and
never binds a port (MineDraft: mpi/minedraft.py; roles: mpi/context.py).
scripts/mpirun_serve.sh has the exact mpirun line. The torch engine opens with MineDraft's
remote drafter and planning policy, so --parallel-draft runs on the torch backend (auto means torch there;
--backend tensorrt-llm is refused). Other world sizes are refused at start-up, on every
rank, with one line naming the world size, what the bundle needs and the command to use.

Prints the listening URL on stdout once the model is loaded and the socket is bound
(`--port 0` picks a free port), serves until SIGINT or SIGTERM, then refuses new work,
aborts what is in flight, stops the engine loop and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import click

from specbuild.cli.options import DrafterCommand, compile_option, shared, telemetry_option
from specbuild.cli.options import trtllm_options
from specbuild.cli.telemetry import open_telemetry
from specbuild.errors import SpecbuildError


@click.command(cls=DrafterCommand)
@click.argument("bundle", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
@click.option("--port", default=8000, show_default=True, type=int, help="TCP port (0: a free one).")
@shared("--max-batch-size")
@shared("--max-queue", help="Requests waiting for admission before new ones get HTTP 429.")
@shared("--threads")
@shared("--device", help="cpu, cuda, cuda:N (torch backend).")
@shared("--backend")
@trtllm_options
@compile_option()
@shared("--kv-cache-tokens")
@shared("--kv-cache-dtype")
@click.option("--prefill-chunk", type=int, default=256, show_default=True,
              help="Most prompt tokens per step, so long prompts do not stall running requests.")
@click.option("--body-timeout", type=float, default=30.0, show_default=True,
              help="Seconds a request body may take to arrive before the server answers 408 (slow clients).")
@click.option("--header-timeout", type=float, default=10.0, show_default=True,
              help="Seconds a connection may take to send its request line and headers (408, or a close "
                   "when nothing came).")
@click.option("--max-header-bytes", type=int, default=64 * 1024, show_default=True,
              help="Most bytes of request line + headers (431 beyond).")
@click.option("--max-headers", type=int, default=128, show_default=True, help="Most header lines (431 beyond).")
@click.option("--max-connections", type=int, default=8192, show_default=True,
              help="Open sockets (capped by the open-file limit); beyond, the longest-idle one is closed.")
@click.option("--max-inflight", type=int, default=1024, show_default=True,
              help="HTTP requests handled at once, streams included (503 beyond); idle sockets do not count.")
@shared("--model-name", help="Name in /v1/models and responses [the bundle directory's name].")
@click.option("--strict-fields", is_flag=True,
              help="Refuse unknown request fields with 400 (default: ignore them, log them and list them in the "
                   "x-specbuild-ignored-fields response header, as vLLM does).")
@click.option("--chat-template", "chat_template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template file replacing the bundle's (as vLLM's --chat-template).")
@click.option("--tool-call-parser", default="hermes", show_default=True, type=click.Choice(["hermes"]),
              help="How tool calls are read out of the model's text (<tool_call>{json}</tool_call>).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--parallel-draft", is_flag=True,
              help="MineDraft: run under `mpirun -disable-auto-cleanup -n 2`; rank 1 drafts while rank 0 verifies.")
@click.option("--draft-timeout", type=float, default=5.0, show_default=True,
              help="Seconds the verifier waits for a draft reply before it decodes without the draft rank for good.")
@shared("--no-prefix-cache")
@telemetry_option
def serve(bundle, host, port, max_batch_size, max_queue, threads, device, backend, compile_, kv_cache_tokens,
          kv_cache_dtype, prefill_chunk,
          body_timeout, header_timeout, max_header_bytes, max_headers, max_connections, max_inflight, model_name,
          strict_fields, chat_template, tool_call_parser, log_level, parallel_draft, draft_timeout, no_prefix_cache,
          telemetry, trtllm, drafters) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API (completions, chat, SSE, /metrics)."""
    from specbuild.cli.main import dist_context, fail_once

    try:
        if not 0.05 <= draft_timeout <= 3600:
            raise ValueError(f"--draft-timeout={draft_timeout} is out of range [0.05, 3600] seconds")
        config_kwargs = dict(host=host, port=port, max_queue=max_queue, model_name=model_name,
                             body_timeout_s=body_timeout, header_timeout_s=header_timeout,
                             max_header_bytes=max_header_bytes, max_headers=max_headers,
                             max_connections=max_connections, max_inflight=max_inflight,
                             strict_fields=strict_fields, tool_parser=tool_call_parser)
        if chat_template is not None:
            with open(chat_template, encoding="utf-8") as f:
                config_kwargs["chat_template"] = f.read(1 << 20)
        from specbuild.serve.openai_http import ServeConfig

        ServeConfig(**config_kwargs)  # the HTTP settings' ranges, before the model loads
        if parallel_draft and backend == "tensorrt-llm":
            raise ValueError("--parallel-draft runs on the torch backend only (MineDraft drives specbuild's "
                             "scheduler); drop --backend tensorrt-llm")
    except ValueError as e:
        fail_once(e)
    ctx = dist_context(bundle, backend, "serve", parallel_draft)
    tag = "" if ctx.role == "single" else f" rank{ctx.rank}"
    if threads is None and ctx.role in ("verifier", "drafter"):  # MineDraft's ranks share the cores
        from specbuild.model.threads import rank_threads

        threads, why = rank_threads(ctx.world_size)
        click.echo(f"rank {ctx.rank}: {threads} thread{'s' if threads != 1 else ''} ({why})", err=True)
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s{tag} %(levelname)s %(name)s: %(message)s")
    if ctx.role == "drafter":
        serve_drafts(ctx, bundle, device, threads, max_batch_size, kv_cache_tokens, prefill_chunk, draft_timeout,
                     not no_prefix_cache)
    transport = engine = sink = minedraft = None
    try:
        from specbuild.backends.select import open_engine
        from specbuild.engine.engine import EngineConfig
        from specbuild.serve.openai_http import OpenAIServer, ServeConfig

        config = ServeConfig(**config_kwargs)
        if ctx.role == "verifier":  # the engine opens with MineDraft's drafter and planning policy
            from specbuild.mpi.minedraft import MpiTransport, plugin

            transport = MpiTransport(ctx)
            minedraft = plugin(bundle, transport, draft_timeout)
        engine = open_engine(bundle, EngineConfig(device=device, threads=threads, max_batch_size=max_batch_size,
                                                  kv_cache_tokens=kv_cache_tokens, prefill_chunk=prefill_chunk,
                                                  compile=compile_, prefix_cache=not no_prefix_cache,
                                                  kv_cache_dtype=kv_cache_dtype, drafters=drafters),
                             backend="torch" if parallel_draft else backend, **({} if parallel_draft else trtllm),
                             **(minedraft.open_kwargs() if minedraft is not None else {}))
        if ctx.role == "worker":
            serve_engine_part(ctx, engine)
        sink = open_telemetry(engine, telemetry, "serve")
        app = OpenAIServer(engine, config)
        if minedraft is not None:
            connect_draft_rank(ctx, engine, app, minedraft)
        url = app.bind()
    except (SpecbuildError, ValueError) as e:
        click.echo(f"error: {'' if ctx.rank == 0 else f'rank {ctx.rank}: '}{e}", err=True)
        if engine is not None:  # leader mode: its shutdown releases the worker ranks
            engine.close()
        sys.exit(2)
    except OSError as e:  # address in use, permission denied
        click.echo(f"error: cannot listen on {host}:{port}: {e.strerror or e}", err=True)
        if transport is not None:
            transport.close()
        if engine is not None:
            engine.close()
        sys.exit(2)

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if stop.is_set():  # a second signal: leave without waiting
            click.echo("forced exit", err=True)
            os._exit(130)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    serving = threading.Thread(target=app.serve_forever, name="specbuild-http", daemon=True)
    serving.start()
    mode = "; MineDraft with a draft rank" if transport is not None else ""
    if ctx.role == "leader":
        mode = f"; leader of {ctx.world_size} MPI ranks (TensorRT-LLM leader mode)"
    click.echo(f"specbuild serving {app.model_name!r} on {url} ({engine.backend_name} backend, loaded in "
               f"{engine.load_seconds:.1f}s; max batch {engine.max_batch_size}, max queue {max_queue}{mode})")
    sys.stdout.flush()
    while not stop.is_set() and serving.is_alive():
        stop.wait(0.5)
    click.echo("shutting down", err=True)
    app.shutdown()
    serving.join(timeout=5)
    engine.close()  # TensorRT-LLM: shuts its executors down
    if sink is not None:  # the writer flushes what is queued
        sink.close()
    if transport is not None:
        transport.close()
    click.echo("stopped", err=True)
    if ctx.role == "verifier":
        # no MPI_Finalize (it hangs when the peer is gone): leave without any MPI teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # single, or the leader: an ordinary exit (in leader mode the workers were released by
    # engine.close() above and exit alike; TensorRT-LLM's MPI finalizes at exit on every rank)


def serve_engine_part(ctx, engine) -> None:
    """A leader-mode rank > 0: no HTTP; this rank's part of the engine runs until rank 0
    shuts down (`parallel.follow_leader`, which `generate` uses too); then exit 0."""
    from specbuild.mpi.context import follow_leader

    log = logging.getLogger("specbuild.serve")
    try:
        if not follow_leader(engine, say=log.info):
            raise SpecbuildError(f"rank {ctx.rank}: the {engine.backend_name} engine takes requests here, but in "
                                 "leader mode only rank 0 may")
    except SpecbuildError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except Exception:
        log.exception("rank %d: the engine failed while following rank 0", ctx.rank)
        sys.exit(1)
    click.echo(f"rank {ctx.rank}: stopped", err=True)
    sys.exit(0)


def serve_drafts(ctx, bundle, device, threads, max_batch_size, kv_cache_tokens, prefill_chunk, draft_timeout,
                 prefix_cache=True):
    """Rank 1: run the draft model for rank 0 until it stops or is gone; never returns."""
    from specbuild.mpi.draft_worker import run_draft_rank
    from specbuild.engine.engine import EngineConfig

    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))  # the verifier owns shutdown
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(0))
    try:
        rc = run_draft_rank(ctx, bundle, EngineConfig(device=device, threads=threads, max_batch_size=max_batch_size,
                                                      kv_cache_tokens=kv_cache_tokens, prefill_chunk=prefill_chunk,
                                                      prefix_cache=prefix_cache),
                            draft_timeout)
    except (SpecbuildError, ValueError) as e:
        click.echo(f"error: draft rank: {e}", err=True)
        rc = 2
    except Exception:
        logging.getLogger("specbuild.serve").exception("the draft rank failed")
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no MPI_Finalize: see mpi/context.py


def connect_draft_rank(ctx, engine, app, minedraft) -> None:
    """Rank 0: wait for the draft rank's hello, check it, make the draft rank the default
    method, and report it in /health."""
    from specbuild.speculation.config import SpeculationConfig

    hello = minedraft.transport.handshake(timeout_s=600)
    if not hello:
        raise SpecbuildError(f"the draft rank did not start: {ctx.reason}")
    if hello["vocab"] != engine.target_config.vocab_size:
        raise SpecbuildError(f"the draft rank drafts over {hello['vocab']} tokens, the target has "
                             f"{engine.target_config.vocab_size}")
    if engine.default_speculation.method not in ("draft", "auto"):  # requests without a setting use the draft rank
        logging.getLogger("specbuild.serve").info("requests without a speculation setting use the draft rank "
                                                  "(the bundle's default is %r)", engine.default_speculation.method)
        engine.default_speculation = SpeculationConfig.make(engine.default_speculation, method="draft")

    def health() -> dict:
        out = minedraft.health()
        out["draft_rank"]["pid"] = hello["pid"]
        out["draft_rank"]["verifier_pid"] = os.getpid()  # rank 0 (under its guard)
        return out

    app.health_checks.append(health)
