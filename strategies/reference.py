"""Regenerate docs/RUN_CONFIG.md with this App's registry: `python -m strategies.reference PATH`
(no path: print it)."""

from __future__ import annotations

import sys
from pathlib import Path

from fedfields.config.reference import reference
from strategies import strategy_settings


def main(argv: list[str]) -> int:
    """Write the reference to the path given, or print it."""
    text = reference(strategy_settings())
    if argv:
        Path(argv[0]).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
