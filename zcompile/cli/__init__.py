"""The ``zcompile`` command (``zcompile.cli:main``): inspect, diff, consolidate, tune-report, simulate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zcompile.common.lazy import lazy_attributes

# public name -> the module that defines it, imported on first use (PEP 562): importing one module
# of this package does not run the others
_LAZY = {
    "main": "zcompile.cli.commands",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from zcompile.cli.commands import main


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
