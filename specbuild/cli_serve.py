"""`specbuild serve BUNDLE`: the OpenAI-compatible HTTP server on one process.

Prints the listening URL on stdout once the model is loaded and the socket is bound
(`--port 0` picks a free port), serves until SIGINT or SIGTERM, then refuses new work,
aborts what is in flight, stops the engine loop and exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

import click

from .errors import SpecbuildError


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
@click.option("--port", default=8000, show_default=True, type=int, help="TCP port (0: a free one).")
@click.option("--max-batch-size", type=int, default=None, help="Most sequences per step [bundle limit].")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests waiting for admission before new ones get HTTP 429.")
@click.option("--threads", type=int, default=None, help="Torch CPU threads.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N.")
@click.option("--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens [enough for a full batch].")
@click.option("--prefill-chunk", type=int, default=256, show_default=True,
              help="Most prompt tokens per step, so long prompts do not stall running requests.")
@click.option("--model-name", default=None, help="Name in /v1/models and responses [the bundle directory's name].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve(bundle, host, port, max_batch_size, max_queue, threads, device, kv_cache_tokens, prefill_chunk,
          model_name, log_level) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API (completions, chat, SSE, /metrics)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from .runtime.engine import Engine, EngineConfig
        from .runtime.server import OpenAIServer, ServeConfig

        config = ServeConfig(host=host, port=port, max_queue=max_queue, model_name=model_name)
        engine = Engine(bundle, EngineConfig(device=device, threads=threads, max_batch_size=max_batch_size,
                                             kv_cache_tokens=kv_cache_tokens, prefill_chunk=prefill_chunk))
        app = OpenAIServer(engine, config)
        url = app.bind()
    except (SpecbuildError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:  # address in use, permission denied
        click.echo(f"error: cannot listen on {host}:{port}: {e.strerror or e}", err=True)
        sys.exit(2)

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if stop.is_set():  # a second signal: leave without waiting
            click.echo("forced exit", err=True)
            import os

            os._exit(130)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    serving = threading.Thread(target=app.serve_forever, name="specbuild-http", daemon=True)
    serving.start()
    click.echo(f"specbuild serving {app.model_name!r} on {url} (loaded in {engine.load_seconds:.1f}s; "
               f"max batch {engine.max_batch_size}, max queue {max_queue})")
    sys.stdout.flush()
    while not stop.is_set() and serving.is_alive():
        stop.wait(0.5)
    click.echo("shutting down", err=True)
    app.shutdown()
    serving.join(timeout=5)
    click.echo("stopped", err=True)
