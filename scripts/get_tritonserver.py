#!/usr/bin/env python3
"""Fetch a CPU-capable tritonserver (2.51) from the `nvidia-pytriton` wheel, for tests and demos.

    python scripts/get_tritonserver.py            # prints the paths as JSON
    python scripts/get_tritonserver.py --shell    # prints `export NAME=...` lines

The wheel is downloaded with `pip download --no-deps` into the cache (default
`.cache/tritonserver/`, or $SPECBUILD_TRITON_CACHE) and never installed: it pins numpy<2.
From it we unpack the server, the Python backend, its shared libraries and the backend
stub built for the running interpreter's Python version. Idempotent: a second run only
prints the paths.

Two facts about that server that shape what this script prepares:
- the stub embeds Python through `libpython3.X.so`: it must load the running interpreter's
  library (its `sysconfig` LIBDIR on LD_LIBRARY_PATH), so the interpreter must be built
  with --enable-shared;
- the stub's C++ side was built against numpy 1.x: under numpy 2 it corrupts TYPE_STRING
  tensors (measured: a 2-byte string arrives with length prefix 0x02020202). So we also
  make a small Python environment, `pyenv-py3.X-<hash>/`, whose own site-packages hold
  numpy<2 and a .pth that adds the running interpreter's site-packages after it (torch,
  tokenizers and specbuild come from there). The model repository points the Python
  backend at it with EXECUTION_ENV_PATH (`specbuild triton-repo --python-env`).

Importable too: `ensure(cache_dir) -> dict` is what the tests and the benchmark call.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

PYTRITON_VERSION = "0.7.0"  # ships tritonserver 2.51.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CACHE = os.environ.get("SPECBUILD_TRITON_CACHE") or os.path.join(ROOT, ".cache", "tritonserver")
MEMBERS = ("pytriton/tritonserver/", "nvidia_pytriton.libs/")


class Unavailable(RuntimeError):
    """The wheel (or a piece of the environment) cannot be had here; the message says why."""


def py_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def find_wheel(cache: str, version: str) -> str | None:
    found = sorted(glob.glob(os.path.join(cache, f"nvidia_pytriton-{version}-*.whl")))
    return found[-1] if found else None


def download_wheel(cache: str, version: str) -> str:
    wheel = find_wheel(cache, version)
    if wheel:
        return wheel
    os.makedirs(cache, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "-q", "-d", cache, f"nvidia-pytriton=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(cache, version)
    if proc.returncode != 0 or wheel is None:
        raise Unavailable(f"pip download nvidia-pytriton=={version} failed (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    return wheel


def extract(wheel: str, dest: str) -> None:
    """Unpack the server and its libraries (with their exec bits) into `dest`, atomically."""
    if os.path.isfile(os.path.join(dest, ".complete")):
        return
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=os.path.dirname(dest))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if not info.filename.startswith(MEMBERS) or info.is_dir():
                    continue
                path = zf.extract(info, tmp)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(path, mode)
        open(os.path.join(tmp, ".complete"), "w").close()
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def backend_dir_for(server_root: str, pyver: str) -> str:
    """A backends directory whose python/ holds the stub for this Python version.

    It sits at the same depth as the wheel's own backends/, so the libraries' RPATH
    ($ORIGIN/../../../../nvidia_pytriton.libs) still resolves."""
    tree = os.path.join(server_root, "pytriton", "tritonserver")
    stub = os.path.join(tree, "python_backend_stubs", pyver, "triton_python_backend_stub")
    if not os.path.isfile(stub):
        have = sorted(os.listdir(os.path.join(tree, "python_backend_stubs")))
        raise Unavailable(f"the wheel has no Python backend stub for Python {pyver} (it has {', '.join(have)})")
    out = os.path.join(tree, f"backends-py{pyver}")
    python_dir = os.path.join(out, "python")
    if not os.path.isfile(os.path.join(python_dir, "triton_python_backend_stub")):
        os.makedirs(python_dir, exist_ok=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(os.path.join(tree, "backends", "python", name), os.path.join(python_dir, name))
        shutil.copy2(stub, os.path.join(python_dir, "triton_python_backend_stub.tmp"))
        os.replace(os.path.join(python_dir, "triton_python_backend_stub.tmp"),
                   os.path.join(python_dir, "triton_python_backend_stub"))
    return out


def python_libdir() -> str:
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ldlibrary = sysconfig.get_config_var("LDLIBRARY") or ""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not os.path.isfile(os.path.join(libdir, ldlibrary)):
        raise Unavailable(f"{sys.executable} has no shared libpython ({os.path.join(libdir, ldlibrary)!r}); the "
                          "Python backend stub needs an interpreter built with --enable-shared")
    return libdir


def project_site_dirs() -> list[str]:
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and os.path.isdir(user):
        dirs.append(user)
    return dirs


def make_python_env(cache: str, numpy_spec: str) -> str:
    """A venv on the interpreter's base Python: numpy<2 first, then the project's site-packages."""
    key = hashlib.sha256(f"{sys.prefix}|{numpy_spec}".encode()).hexdigest()[:10]
    env = os.path.join(cache, f"pyenv-py{py_version()}-{key}")
    marker = os.path.join(env, ".complete")
    if os.path.isfile(marker):
        return env
    # built in place (a venv's activate script records its own path), complete when marked
    shutil.rmtree(env, ignore_errors=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    proc = subprocess.run([base, "-m", "venv", "--without-pip", env], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Unavailable(f"cannot create the stub's Python environment: {proc.stderr.strip()[-300:]}")
    site_dir = os.path.join(env, "lib", f"python{py_version()}", "site-packages")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q",
                           "--only-binary", ":all:", "--target", site_dir, numpy_spec], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(env, ignore_errors=True)
        raise Unavailable(f"pip install {numpy_spec!r} for the stub failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    with open(os.path.join(site_dir, "zz_specbuild_project.pth"), "w") as f:
        # one line, run by site.py at start-up: the project's packages, after numpy<2
        f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in project_site_dirs()) + "\n")
    open(marker, "w").close()
    return env


def ensure(cache: str = DEFAULT_CACHE, version: str = PYTRITON_VERSION, numpy_spec: str = "numpy<2",
           wheel: str | None = None) -> dict[str, str]:
    """Everything needed to run tritonserver with this interpreter's stub; raises Unavailable."""
    cache = os.path.abspath(cache)
    os.makedirs(cache, exist_ok=True)
    libdir = python_libdir()
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent callers (test workers) wait for one unpacking
        return _ensure_locked(cache, version, numpy_spec, wheel, libdir)


def _ensure_locked(cache: str, version: str, numpy_spec: str, wheel: str | None, libdir: str) -> dict[str, str]:
    wheel = wheel or download_wheel(cache, version)
    server_root = os.path.join(cache, f"pytriton-{version}")
    extract(wheel, server_root)
    backend_dir = backend_dir_for(server_root, py_version())
    libs = os.path.join(server_root, "nvidia_pytriton.libs")
    return {
        "version": version,
        "wheel": wheel,
        "tritonserver": os.path.join(server_root, "pytriton", "tritonserver", "bin", "tritonserver"),
        "backend_dir": backend_dir,
        "libs_dir": libs,
        "python_libdir": libdir,
        "python_env": make_python_env(cache, numpy_spec),
        "ld_library_path": os.pathsep.join([libdir, libs]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="cache directory [%(default)s]")
    ap.add_argument("--version", default=PYTRITON_VERSION, help="nvidia-pytriton version [%(default)s]")
    ap.add_argument("--wheel", default=None, help="use this nvidia-pytriton wheel file instead of downloading")
    ap.add_argument("--numpy", default="numpy<2", help="numpy requirement for the stub's environment [%(default)s]")
    ap.add_argument("--shell", action="store_true", help="print `export NAME=value` lines instead of JSON")
    args = ap.parse_args(argv)
    try:
        paths = ensure(args.cache, args.version, args.numpy, args.wheel)
    except Unavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.shell:
        for key, value in paths.items():
            print(f"export TRITON_{key.upper()}={shlex_quote(value)}")
    else:
        print(json.dumps(paths, indent=2))
    return 0


def shlex_quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


if __name__ == "__main__":
    sys.exit(main())
