"""Triton Inference Server front end: a model repository whose Python-backend model drives
specbuild's engine (streaming, batch > 1, per-request speculation).

    from specbuild.serve.tritonserver import RepoConfig, write_repository
    write_repository("bundle/", "repo/", RepoConfig(model_name="specbuild", python_env=...))

`server_command` builds the tritonserver command line and environment for a repository
(what scripts/triton_serve.sh, the tests and scripts/bench_triton.py run).
"""

from __future__ import annotations

import os

from specbuild.serve.tritonserver_repo import INPUTS, OUTPUTS, PLAIN_SUFFIX, RepoConfig, write_repository

__all__ = ["INPUTS", "OUTPUTS", "PLAIN_SUFFIX", "RepoConfig", "write_repository", "server_command"]


def server_command(paths: dict[str, str], repo: str, http_port: int, grpc_port: int, metrics_port: int,
                   host: str = "127.0.0.1", extra_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) to run tritonserver on `repo`, bound to `host`.

    paths: what scripts/get_tritonserver.py returns (tritonserver, backend_dir,
    ld_library_path). LD_LIBRARY_PATH puts the interpreter's LIBDIR first, so the backend
    stub loads the same libpython as the Python it runs."""
    for port in (http_port, grpc_port, metrics_port):
        if not 0 < port < 65536:
            raise ValueError(f"port={port} is out of range [1, 65535]")
    argv = [paths["tritonserver"], f"--model-repository={os.path.abspath(repo)}",
            f"--backend-directory={paths['backend_dir']}",
            f"--http-address={host}", f"--http-port={http_port}",
            f"--grpc-address={host}", f"--grpc-port={grpc_port}",
            f"--metrics-address={host}", f"--metrics-port={metrics_port}",
            "--allow-cpu-metrics=false", "--allow-gpu-metrics=false", "--disable-auto-complete-config",
            "--exit-timeout-secs=5", "--log-verbose=0"]
    env = dict(os.environ)
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = paths["ld_library_path"] + (os.pathsep + old if old else "")
    env.update(extra_env or {})
    return argv, env
