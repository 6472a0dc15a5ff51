"""Registers the subcommands that live in their own modules (bench, serve, verify, ...).

Each module exposes a click command; importing them lazily keeps `specbuild --help` fast.
"""

from __future__ import annotations

import importlib

import click

# command name -> (module, attribute)
COMMANDS: dict[str, tuple[str, str]] = {
    "train-medusa": (".medusa", "train_medusa_cmd"),
    "export-medusa": (".medusa", "export_medusa_cmd"),
    "train-draft": (".draft", "train_draft_cmd"),
    "export-draft": (".draft", "export_draft_cmd"),
    "train-eagle": (".eagle", "train_eagle_cmd"),
    "export-eagle": (".eagle", "export_eagle_cmd"),
    "serve": (".serve", "serve"),
    "bench": (".bench", "bench"),
    "verify": (".verify", "verify"),
    "triton-repo": (".tritonserver", "triton_repo"),
    "telemetry": (".telemetry", "telemetry"),
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when it is used (or listed),
    so `specbuild --help` stays fast and modules may import specbuild.cli.main freely."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx, name):
        if name in COMMANDS and name not in self.commands:
            module, attr = COMMANDS[name]
            self.add_command(getattr(importlib.import_module(module, __package__), attr), name)
        return super().get_command(ctx, name)
