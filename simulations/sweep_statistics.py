"""The sweep's pure parts: grid expansion, setting names, a run's final metrics, statistics
over seeds (mean ± sample std, paired differences with a Student-t interval) and the tables.

`simulations.sweep` does the files and processes around them; everything here is a function of
its arguments, so it is tested against numbers computed another way (tests/test_sweep.py).
"""

from __future__ import annotations

import ast
import csv
import io
import itertools
import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats

RunValue = bool | int | float | str
"""A run-config value: Flower's run-config holds only these."""
BASE_NAME = "base"
"""The one setting of a sweep without a grid: the base run-config alone."""
SKIPPED_FINAL_KEYS = ("round", "seconds")
"""Bookkeeping in a meta job's "final" (its last round's line), not a score."""
UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9._=,+-]")
CONFIDENCE = 0.95
Results = Mapping[str, Mapping[int, Mapping[str, float]]]
"""Finished runs' final metrics: results[setting][seed][metric]."""


@dataclass(frozen=True)
class Summary:
    """One metric over a setting's seeds: how many, their mean and sample std (ddof=1; NaN
    below two values)."""

    n: int
    mean: float
    std: float


@dataclass(frozen=True)
class Paired:
    """A − B per seed both finished, their mean and its Student-t interval (NaN below two)."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly above or wholly below 0."""
        return self.low > 0 or self.high < 0


def parse_value_list(key: str, text: str) -> list[RunValue]:
    """`text`, a TOML or Python list literal of run-config values; ValueError naming `key`."""
    try:
        values = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            values = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(
                f"--grid {key}: {text!r} is neither a TOML nor a Python list literal"
            ) from None
    if not isinstance(values, list | tuple) or not values:
        raise ValueError(f"--grid {key}: expected a non-empty list like [1, 2], got {text!r}")
    for value in values:
        if not isinstance(value, RunValue):
            raise ValueError(
                f"--grid {key}: {value!r} is not a run-config value (bool, int, float or str)"
            )
    if len(set(map(repr, values))) < len(values):
        raise ValueError(f"--grid {key}: {text!r} repeats a value")
    return list(values)


def parse_grid(text: str) -> tuple[str, list[RunValue]]:
    """`key=[v1, v2]` as (key, values)."""
    key, equals, values = text.partition("=")
    key = key.strip()
    if not equals or not re.fullmatch(r"[a-z][a-z0-9-]*", key):
        raise ValueError(f"--grid {text!r}: expected key=[v1, v2], e.g. \"strategy=['fedavg']\"")
    return key, parse_value_list(key, values.strip())


def expand_grid(grids: Sequence[tuple[str, Sequence[RunValue]]]) -> list[dict[str, RunValue]]:
    """Every combination of the grids' values (the first grid varies slowest); [{}] for none."""
    keys = [key for key, _ in grids]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"--grid {repeated[0]!r} is given twice; list all its values in one")
    return [
        dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in grids))
    ]


def typed(value: RunValue, expected: type) -> RunValue:
    """`value` as its run-config key's declared type: an int for a float key becomes a float, so
    `alpha-lr=[0, 0.1]` names its settings 0.0 and 0.1; other types are left to the job's check."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def format_value(value: RunValue) -> str:
    """How a value reads in a setting's name: strings bare, the rest as TOML writes them."""
    return value if isinstance(value, str) else json.dumps(value)


def setting_name(values: Mapping[str, RunValue]) -> str:
    """`key=value,key=value` in grid order (a folder name: other characters become `_`)."""
    if not values:
        return BASE_NAME
    joined = ",".join(f"{key}={format_value(value)}" for key, value in values.items())
    return UNSAFE_IN_NAME.sub("_", joined)


def setting_names(settings: Sequence[Mapping[str, RunValue]]) -> list[str]:
    """Each setting's name; ValueError when two settings would share one (and a folder)."""
    names = [setting_name(values) for values in settings]
    for first, second in itertools.combinations(range(len(names)), 2):
        if names[first] == names[second]:
            raise ValueError(
                f"settings {dict(settings[first])} and {dict(settings[second])} would both be "
                f"named {names[first]!r}"
            )
    return names


def flatten_numbers(tree: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The int and float leaves of nested mappings, named by their dotted path (bools skipped)."""
    flat: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten_numbers(value, f"{name}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def is_complete(summary: object) -> bool:
    """Whether a parsed summary.json is a finished run's: its scores ("final"; the split job's
    "client") and its total "seconds"."""
    if not isinstance(summary, dict) or not isinstance(summary.get("seconds"), int | float):
        return False
    return isinstance(summary.get("final", summary.get("client")), dict)


def final_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """A finished run's final metrics: the numeric leaves of summary.json's "final" (the split
    job's "client"), dotted, without a meta job's bookkeeping (`SKIPPED_FINAL_KEYS`), then the
    run's total "seconds"."""
    scores = summary.get("final", summary.get("client", {}))
    kept = {key: value for key, value in scores.items() if key not in SKIPPED_FINAL_KEYS}
    return flatten_numbers(kept) | {"seconds": float(summary["seconds"])}


def describe(values: Sequence[float]) -> Summary:
    """n, mean and sample std (ddof=1) of `values`; NaN mean for none, NaN std below two."""
    n = len(values)
    if n == 0:
        return Summary(0, math.nan, math.nan)
    mean = math.fsum(values) / n
    if n < 2:
        return Summary(n, mean, math.nan)
    return Summary(n, mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)))


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> Paired:
    """A − B over the seeds both have, with the mean's 95% Student-t interval (n − 1 degrees
    of freedom; NaN bounds below two seeds)."""
    seeds = tuple(sorted(a.keys() & b.keys()))
    differences = tuple(a[seed] - b[seed] for seed in seeds)
    summary = describe(differences)
    if summary.n < 2:
        return Paired(seeds, differences, summary.mean, math.nan, math.nan)
    quantile = float(stats.t.ppf((1 + CONFIDENCE) / 2, summary.n - 1))
    half = quantile * summary.std / math.sqrt(summary.n)
    return Paired(seeds, differences, summary.mean, summary.mean - half, summary.mean + half)


def metric_order(results: Results) -> list[str]:
    """Every metric of any run, in the order first met (settings, then seeds, then keys)."""
    order: dict[str, None] = {}
    for runs in results.values():
        for metrics in runs.values():
            order |= dict.fromkeys(metrics)
    return list(order)


def setting_stats(results: Results) -> list[tuple[str, str, Summary]]:
    """(metric, setting, its summary over the setting's seeds) metric by metric, settings in
    sweep order, over the finished runs; a setting without the metric is left out."""
    found = []
    for metric in metric_order(results):
        for setting, runs in results.items():
            values = [metrics[metric] for metrics in runs.values() if metric in metrics]
            if values:
                found.append((metric, setting, describe(values)))
    return found


def pair_stats(a: str, b: str, results: Results) -> list[tuple[str, Paired]]:
    """(metric, A − B) for every metric with a seed both settings finished."""
    runs_a, runs_b = results.get(a, {}), results.get(b, {})
    found = []
    for metric in metric_order(results):
        of_a = {seed: metrics[metric] for seed, metrics in runs_a.items() if metric in metrics}
        of_b = {seed: metrics[metric] for seed, metrics in runs_b.items() if metric in metrics}
        paired = paired_difference(of_a, of_b)
        if paired.seeds:
            found.append((metric, paired))
    return found


def number(value: float) -> str:
    """A float for the CSV: full precision (`repr`), empty when NaN."""
    return "" if math.isnan(value) else repr(value)


def short(value: float) -> str:
    """A float as the markdown shows it: 4 significant digits; '–' when NaN."""
    return "–" if math.isnan(value) else f"{value:.4g}"


def excludes_zero(paired: Paired) -> str:
    """yes / no, or '' when there is no interval (one seed)."""
    return "" if math.isnan(paired.low) else ("yes" if paired.excludes_zero else "no")


def csv_text(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """`header` and `rows` as CSV."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """`header` and `rows` as a GitHub markdown table (a `|` in a cell escaped)."""
    lines = [list(header), ["---"] * len(header), *map(list, rows)]
    return "".join(
        "| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |\n" for line in lines
    )


SETTING_HEADER = ("metric", "setting", "n", "mean", "std")
PAIR_HEADER = ("a", "b", "metric", "n", "mean", "ci95-low", "ci95-high", "excludes-0",
               "seeds", "differences")  # fmt: skip


def setting_csv(found: Sequence[tuple[str, str, Summary]]) -> str:
    """table.csv: metric, setting, n, mean, std (empty when undefined)."""
    rows = [
        [metric, setting, str(s.n), number(s.mean), number(s.std)] for metric, setting, s in found
    ]
    return csv_text(SETTING_HEADER, rows)


def setting_markdown(found: Sequence[tuple[str, str, Summary]]) -> str:
    """The settings' table as markdown: metric | setting | mean ± std | n."""
    rows = [
        [metric, f"`{setting}`", f"{short(s.mean)} ± {short(s.std)}", str(s.n)]
        for metric, setting, s in found
    ]
    return markdown_table(("metric", "setting", "mean ± std", "n"), rows)


def pair_csv_rows(a: str, b: str, found: Sequence[tuple[str, Paired]]) -> list[list[str]]:
    """pairs.csv's rows for A − B: the interval's bounds empty below two seeds; seeds and
    differences as space-separated lists."""
    return [
        [a, b, metric, str(len(p.seeds)), number(p.mean), number(p.low), number(p.high),
         excludes_zero(p), " ".join(map(str, p.seeds)), " ".join(map(number, p.differences))]
        for metric, p in found
    ]  # fmt: skip


def pair_markdown(a: str, b: str, found: Sequence[tuple[str, Paired]]) -> str:
    """A − B as markdown: a heading, then metric | n | mean | 95% interval | excludes 0 |
    the per-seed differences."""
    rows = [
        [metric, str(len(p.seeds)), short(p.mean), f"[{short(p.low)}, {short(p.high)}]",
         excludes_zero(p) or "–",
         ", ".join(f"{seed}: {short(d)}" for seed, d in zip(p.seeds, p.differences, strict=True))]
        for metric, p in found
    ]  # fmt: skip
    header = ("metric", "n", "mean A − B", "95% interval (t)", "excludes 0", "seed: A − B")
    return f"### `{a}` − `{b}`\n\n" + markdown_table(header, rows)
