"""The command line (click only): each command parses, builds a config and calls one library function."""

from specbuild.cli.main import main

__all__ = ["main"]
