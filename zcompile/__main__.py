"""``python -m zcompile inspect DIR`` / ``python -m zcompile diff DIR_A DIR_B`` (see ``zcompile.cli``)."""

from zcompile.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
