"""Registers the subcommands that live in their own modules (bench, serve, verify, ...).

Each module exposes a click command; importing them lazily keeps `specbuild --help` fast.
"""

from __future__ import annotations

import importlib

import click

# command name -> (module, attribute)
COMMANDS: dict[str, tuple[str, str]] = {
    "train-medusa": (".cli_medusa", "train_medusa_cmd"),
    "export-medusa": (".cli_medusa", "export_medusa_cmd"),
    "serve": (".cli_serve", "serve"),
    "bench": (".cli_bench", "bench"),
    "verify": (".cli_verify", "verify"),
}


def register(group: click.Group) -> None:
    for name, (module, attr) in COMMANDS.items():
        group.add_command(importlib.import_module(module, __package__).__dict__[attr], name)
