"""docs/RUN_CONFIG.md, generated from the section dataclasses and the strategies' settings
so the reference never drifts.

The App regenerates it with its registry: `python -m strategies.reference docs/RUN_CONFIG.md`.
"""

from __future__ import annotations

import inspect
from dataclasses import fields

from fedfields.config.schema import SECTIONS, StrategyTable, dash, strategy_keys

HEADER = """# Run-config reference

Generated from `fedfields/config/schema.py` and the strategies' own settings (the App's
registry, `strategies/__init__.py`) by `python -m strategies.reference docs/RUN_CONFIG.md`;
`tests/test_run_config.py` fails when this file is stale. Every key is in
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
(`FederatedConfig.unread_keys`). Every numeric key is bounded: a value outside its range (a
count above 1,000,000, a learning rate the fields cannot take, dp-noise-multiplier outside 0
or [1e-12, 1000], dp-clip-norm above 1e6, both split defences at once) is refused with one
error naming the key and its range, and each key's smallest and largest accepted values run
end to end (`tests/test_setting_extremes.py`).
"""


STRATEGIES_HEADER = """
## strategies (`config.settings`, used by the strategy that declares the key)

Each strategy module declares its own keys (a `StrategySettings` dataclass); the App's
registry maps the strategy's name to its class and those settings. A key changed from its
default under a strategy that does not read it is refused. Registered strategies (the values
of `strategy`): {names}.

| key | type | default | meaning |
|---|---|---|---|
"""


def _cell(value: object) -> str:
    """A default as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def reference(strategies: StrategyTable) -> str:
    """The markdown reference: one table per section, in `SECTIONS` order, then one row per
    strategy's own key with the strategies reading it."""
    parts = [HEADER]
    for name, section in SECTIONS.items():
        doc = " ".join(inspect.cleandoc(section.__doc__ or "").split())
        parts.append(f"\n## {section.title} (`config.{name}`, used by {section.used_by})\n")
        parts.append(f"\n{doc}\n\n| key | type | default | meaning |\n|---|---|---|---|\n")
        for spec in fields(section):
            parts.append(_row(dash(spec.name), spec.default, spec.metadata["doc"]))
    names = ", ".join(f"`{name}`" for name in strategies)
    parts.append(STRATEGIES_HEADER.replace("{names}", names))
    for run_key, readers in strategy_keys(strategies).items():
        spec = strategies[readers[0]].keys()[run_key]
        meaning = f"{spec.metadata['doc']} (read by {', '.join(readers)})"
        parts.append(_row(run_key, spec.default, meaning))
    return "".join(parts)


def _row(run_key: str, default: object, meaning: str) -> str:
    """One key's table row."""
    escaped = meaning.replace("|", "\\|")
    return f"| `{run_key}` | {type(default).__name__} | {_cell(default)} | {escaped} |\n"
