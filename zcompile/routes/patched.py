"""The mark of a torch function zcompile replaced: its wrapper carries the original under
``ORIGINAL_ATTR``, so an install runs once per process and the original stays reachable."""

ORIGINAL_ATTR = "__zcompile_original__"


def is_patched(function) -> bool:
    """``function`` is a zcompile wrapper (its install already ran)."""
    return hasattr(function, ORIGINAL_ATTR)
