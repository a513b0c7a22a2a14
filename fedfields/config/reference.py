"""docs/RUN_CONFIG.md, generated from the section dataclasses so the reference never drifts.

Regenerate: `python -m fedfields.config.reference docs/RUN_CONFIG.md`.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import fields
from pathlib import Path

from fedfields.config.schema import SECTIONS, dash

HEADER = """# Run-config reference

Generated from `fedfields/config/schema.py` by `python -m fedfields.config.reference
docs/RUN_CONFIG.md`; `tests/test_run_config.py` fails when this file is stale. Every key is in
`pyproject.toml`'s `[tool.flwr.app.config]` with its default; override keys with
`flwr run . --run-config "local-steps=16 alpha-lr=0.05"` or
`make demo RUN_CONFIG="local-steps=16"`. A key the run does not read, changed from its
default, is refused with the setting that reads it and this run's task and mode: a key of a
section the run does not use, a key split mode never reads, a strategy's own setting under
another strategy, gamma, privacy-budget and memorising-bound under another meta-learner
(gamma beside a privacy budget too), secagg-* without secure-aggregation, max-update-norm
with it, trim-fraction beside another aggregation-rule, num-malicious beside a rule other
than krum, multi-krum and bulyan, krum-select beside another rule, and dp-clip-norm,
dp-delta, dp-target-epsilon and dp-max-noise-ratio beside dp-noise-multiplier = 0, and
compression-rank, compression-bits and compression-fraction beside another compression
(`FederatedConfig.unread_keys`).
"""


def _cell(value: object) -> str:
    """A default as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def reference() -> str:
    """The markdown reference: one table per section, in `SECTIONS` order."""
    parts = [HEADER]
    for name, section in SECTIONS.items():
        doc = " ".join(inspect.cleandoc(section.__doc__ or "").split())
        parts.append(f"\n## {section.title} (`config.{name}`, used by {section.used_by})\n")
        parts.append(f"\n{doc}\n\n| key | type | default | meaning |\n|---|---|---|---|\n")
        for spec in fields(section):
            kind = type(spec.default).__name__
            meaning = spec.metadata["doc"].replace("|", "\\|")
            parts.append(f"| `{dash(spec.name)}` | {kind} | {_cell(spec.default)} | {meaning} |\n")
    return "".join(parts)


def main(argv: list[str]) -> int:
    """Write the reference to the path given, or print it."""
    if argv:
        Path(argv[0]).write_text(reference())
    else:
        print(reference(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
