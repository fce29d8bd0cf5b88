"""The ``zcompile`` command (``zcompile.cli:main``): inspect, diff, consolidate, tune-report, simulate."""

from zcompile.cli.commands import main

__all__ = ["main"]
