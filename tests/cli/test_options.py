"""Each command-line option is declared once: a name two commands share lives in
specbuild/cli/options.py (SHARED) and commands name it with `shared(...)`; only the names below,
which mean different things in different commands, are declared more than once."""

from __future__ import annotations

import ast
import os

import click

from specbuild.cli.main import main
from specbuild.cli.options import SHARED, shared

CLI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specbuild", "cli")

# name -> why the same name is declared separately
SAME_NAME_OTHER_MEANING = {
    "--backend": "compile: the backend to build for (torch or tensorrt-llm); elsewhere: which one runs (auto too)",
    "--speculation": "generate: one method (a choice); bench and verify: a comma-separated list of methods",
    "--tokens": "train-draft: answer tokens to distil; verify: generated tokens compared jointly",
    "--layers": "train-draft: decoder layers of the draft; train-medusa: residual blocks per head",
    "--tree": "bench: a comma-separated list of trees, a Medusa row each; elsewhere: the one tree to use",
}


def declared_options() -> dict[str, list[str]]:
    """Option name -> 'file:line' of every click.option(...) call in specbuild/cli/ that declares it."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(CLI)):
        if not name.endswith(".py"):
            continue
        path = os.path.join(CLI, name)
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "option"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "click"):
                continue
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    for flag in arg.value.split("/"):  # --plain/--no-plain
                        out.setdefault(flag.strip(), []).append(f"{name}:{node.lineno}")
    return out


def test_every_option_is_declared_once():
    declared = declared_options()
    assert "--out" not in declared and "--threads" not in declared  # both are SHARED
    copied = {flag: where for flag, where in declared.items()
              if len(where) > 1 and flag not in SAME_NAME_OTHER_MEANING}
    assert not copied, f"options declared more than once (declare them in cli/options.py SHARED): {copied}"
    redeclared = {flag: where for flag, where in declared.items() if flag in SHARED and flag not in SAME_NAME_OTHER_MEANING}
    assert not redeclared, f"SHARED options declared again with click.option: {redeclared}"
    for flag in SAME_NAME_OTHER_MEANING:
        assert len(declared.get(flag, [])) + (flag in SHARED) > 1, f"{flag} has one meaning now: drop it from SAME_NAME_OTHER_MEANING"


def test_shared_options_keep_their_meaning_where_used():
    """The commands' options as a user sees them: the shared declaration with the command's default."""
    ctx = click.Context(main)

    def params(*path):
        cmd = main
        for name in path:
            cmd = cmd.get_command(ctx, name)
        return {p.opts[0]: p for p in cmd.params}

    assert params("bench")["--threads"].default == 2
    assert params("serve")["--threads"].default is None and params("serve")["--threads"].type is click.INT
    assert params("verify")["--top-k"].default == 3 and params("generate")["--top-k"].default is None
    assert params("train-medusa")["--lr"].default == 3e-3 and params("train-draft")["--lr"].default == 3e-4
    assert params("triton-repo")["--out"].name == "out" and params("compile")["--out"].name == "out_dir"
    assert params("generate")["--prompt"].required and not params("verify")["--prompt"].required
    assert params("telemetry", "policy", "set")["--gamma-max"].default == 8
    for path in (("generate",), ("serve",), ("bench",), ("verify",), ("triton-repo",)):
        assert params(*path)["--compile"].name == "compile_"


def test_shared_refuses_an_unknown_name():
    try:
        shared("--no-such-option")
    except KeyError as e:
        assert "--no-such-option" in str(e)
    else:
        raise AssertionError("shared() accepted an undeclared option")
