"""`specbuild triton-repo BUNDLE --out REPO`: write a Triton model repository for a bundle.

The repository holds <name> (decoupled Python-backend model that loads the bundle and streams)
and <name>_plain (a light front for unary HTTP/gRPC infer). scripts/triton_serve.sh writes one
and starts tritonserver on it.
"""

from __future__ import annotations

import os
import sys

import click

from specbuild.errors import SpecbuildError
from specbuild.cli.options import DrafterCommand, compile_option, shared
from specbuild.cli.options import trtllm_options


@click.command(cls=DrafterCommand)
@click.argument("bundle", type=click.Path())
@shared("--out", decls=("--out", "out"), help="Model repository directory (created).")
@shared("--model-name", default="specbuild", show_default=True, help="Triton model name.")
@shared("--max-queue", help="Requests waiting for admission before new ones get an UNAVAILABLE error.")
@shared("--max-batch-size")
@shared("--threads", help="Torch CPU threads in the model instance.")
@shared("--device")
@shared("--kv-cache-tokens")
@compile_option()
@click.option("--python-env", type=click.Path(), default=None,
              help="Environment (with bin/activate) the backend stub runs in (EXECUTION_ENV_PATH); "
                   "scripts/get_tritonserver.py prints one.")
@click.option("--plain/--no-plain", default=True, show_default=True,
              help="Also write <name>_plain, a non-decoupled front for unary HTTP/gRPC infer.")
@click.option("--plain-instances", type=int, default=2, show_default=True,
              help="Instances of <name>_plain (concurrent unary requests).")
@shared("--backend", help="auto: TensorRT-LLM where the bundle's engines are built and it runs there, else torch.")
@trtllm_options
@click.option("--engine-factory", default="specbuild.backends.select:open_engine", show_default=True,
              help="module:callable that builds the engine from (bundle, EngineConfig) (--backend: default only).")
@shared("--telemetry", help="The engine model records speculation telemetry into DB (SQLite file or postgresql:// DSN).")
@click.option("--triton-max-batch-size", type=int, default=64, show_default=True,
              help="config.pbtxt's max_batch_size: > 0 takes [batch, 1] tensors as TensorRT-LLM's ensemble does; "
                   "0 writes the older [1] layout.")
@shared("--no-prefix-cache")
def triton_repo(bundle, out, model_name, max_queue, max_batch_size, threads, device, kv_cache_tokens, compile_, python_env,
                plain, plain_instances, backend, engine_factory, telemetry, triton_max_batch_size, no_prefix_cache,
                trtllm, drafters) -> None:
    """Write a Triton model repository that serves BUNDLE with speculative decoding."""
    from specbuild.serve.tritonserver_repo import RepoConfig, write_repository

    try:
        config = RepoConfig(model_name=model_name, max_queue=max_queue, python_env=python_env, threads=threads,
                            max_batch_size=max_batch_size, device=device, kv_cache_tokens=kv_cache_tokens,
                            plain=plain, plain_instances=plain_instances, engine_factory=engine_factory,
                            backend=backend, telemetry=telemetry, compile=compile_,
                            triton_max_batch_size=triton_max_batch_size, prefix_cache=not no_prefix_cache,
                            drafters=drafters, **trtllm)
        names = write_repository(bundle, out, config)
    except (SpecbuildError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        click.echo(f"error: cannot write {out!r}: {e.strerror or e}", err=True)
        sys.exit(2)
    click.echo(f"wrote {', '.join(names)} to {os.path.abspath(out)}")
