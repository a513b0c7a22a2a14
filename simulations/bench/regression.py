"""Benchmark (issue 54): the demo's quality guard. Runs the demo's setting (the App's run-config
defaults: DecentNeRF's 16-user crowd, 8 of 16 users a round, 32 local steps) at `--rounds` (8,
the demo's) for DecentNeRF and FedAvg at `--seed`, through the launcher and Ray as the sweep runs
them (`simulations.sweep`), and prints each run's final clean PSNR (all 80 clean views) beside
the figure recorded in docs/BENCHMARKS.md's table "Demo regression guard", flagging every change
beyond `--tolerance` (0.1 dB).

Seeded runs are exact (one seed, one run), so a change is a change of behaviour, not noise: a
session that changes training, rendering, loss or aggregation code runs this and says so; when
the change is meant, it re-measures the demo rows over seeds and records the new figures.
The exit status is 0 when every figure is within the tolerance, 1 when one moved (or a run
failed, or a setting has no recorded figure), 2 for bad usage. `--runs DIR` compares a finished
guard's runs again without training.

    python -m simulations.bench.regression
    python -m simulations.bench.regression --strategies decentnerf --seed 1
    python -m simulations.bench.regression --runs runs/regression-seed0-rounds8
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from simulations import APP_DIR, sweep
from simulations.bench.devices import add_cpu_only_device_argument

RESULTS_PAGE = APP_DIR / "docs" / "BENCHMARKS.md"
GUARD_HEADING = "Demo regression guard"
"""The heading of the results page's section whose table holds the recorded figures."""
METRIC = "clean-psnr"
DEFAULT_STRATEGIES = ("decentnerf", "fedavg")
DEFAULT_TOLERANCE = 0.1
ROW = re.compile(r"^\|\s*`?([\w-]+)`?\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([-+]?\d+(?:\.\d+)?)\s*\|")
"""A recorded row: | strategy | seed | rounds | clean PSNR | ... (the rest is free text)."""


@dataclass(frozen=True)
class Figure:
    """One guarded figure: a strategy's final clean PSNR at a seed after some rounds."""

    strategy: str
    seed: int
    rounds: int
    psnr: float


@dataclass(frozen=True)
class Comparison:
    """Today's figure beside the recorded one (None where either is missing)."""

    strategy: str
    seed: int
    rounds: int
    recorded: float | None
    today: float | None

    @property
    def change(self) -> float | None:
        """today - recorded in dB, None without both."""
        if self.recorded is None or self.today is None:
            return None
        return self.today - self.recorded

    def verdict(self, tolerance: float) -> str:
        """The verdict: same within `tolerance`, CHANGED beyond it, or what is missing."""
        if self.today is None:
            return "RUN FAILED"
        if self.recorded is None:
            return "NOT RECORDED"
        change = self.change
        assert change is not None
        return "same" if round(abs(change), 9) <= tolerance else "CHANGED"  # 9: float noise


def recorded_figures(markdown: str, source: str = "docs/BENCHMARKS.md") -> list[Figure]:
    """The figures in the table under the "Demo regression guard" heading of `markdown`;
    ValueError naming `source` when the section or its rows are missing."""
    lines = markdown.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("#") and GUARD_HEADING in line]
    if not starts:
        raise ValueError(f"{source}: no section headed {GUARD_HEADING!r}")
    figures = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("#"):
            break
        match = ROW.match(line)
        if match:
            strategy, seed, rounds, psnr = match.groups()
            figures.append(Figure(strategy, int(seed), int(rounds), float(psnr)))
    if not figures:
        raise ValueError(f"{source}: the {GUARD_HEADING!r} section holds no figure rows")
    return figures


def compare(
    recorded: Sequence[Figure], today: Mapping[str, float | None], seed: int, rounds: int
) -> list[Comparison]:
    """Each strategy of `today` (its final clean PSNR, None for a failed run) beside its
    recorded figure at the same seed and rounds."""
    known = {(f.strategy, f.seed, f.rounds): f.psnr for f in recorded}
    return [
        Comparison(strategy, seed, rounds, known.get((strategy, seed, rounds)), value)
        for strategy, value in today.items()
    ]


def table(comparisons: Sequence[Comparison], tolerance: float) -> str:
    """The guard's markdown table: recorded, today, change and verdict per strategy."""

    def db(value: float | None) -> str:
        return "-" if value is None or math.isnan(value) else f"{value:.3f}"

    def signed(value: float | None) -> str:
        return "-" if value is None else f"{round(value, 3) + 0.0:+.3f}"  # no "-0.000"

    rows = [
        "| strategy | seed | rounds | recorded clean PSNR (dB) | today (dB) | change (dB) | "
        f"verdict (tolerance {tolerance:g} dB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        rows.append(
            f"| {c.strategy} | {c.seed} | {c.rounds} | {db(c.recorded)} | {db(c.today)} | "
            f"{signed(c.change)} | {c.verdict(tolerance)} |"
        )
    return "\n".join(rows)


def sweep_argv(args: argparse.Namespace, out: Path) -> list[str]:
    """The sweep that runs the guard's settings: strategy x one seed at the demo's defaults."""
    strategies = ", ".join(f"'{name}'" for name in args.strategies)
    argv = [
        "--grid",
        f"strategy=[{strategies}]",
        "--run-config",
        f"num-server-rounds={args.rounds} server-device='{args.device}'",
    ]
    argv += ["--seeds", str(args.seed), "--sweep-dir", str(out)]
    return [*argv, "--", *args.launcher_args] if args.launcher_args else argv


def default_out(seed: int, rounds: int) -> Path:
    """runs/regression-<UTC time>-seed<s>-rounds<r>: a fresh folder, so a rerun trains anew
    (the sweep would otherwise take the finished runs of an earlier code)."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return APP_DIR / "runs" / f"regression-{stamp}-seed{seed}-rounds{rounds}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.bench.regression",
        description="Run the demo's setting for DecentNeRF and FedAvg at one seed and flag every "
        "final clean PSNR that moved from docs/BENCHMARKS.md's recorded figure.",
    )
    parser.add_argument("--seed", type=int, default=0, help="run-config seed (default 0)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds (default 8, the demo's)")
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=list(DEFAULT_STRATEGIES),
        help="strategies to guard (default: decentnerf fedavg)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="largest change in dB that passes (default 0.1)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS_PAGE,
        help="the results page holding the recorded figures (default docs/BENCHMARKS.md)",
    )
    parser.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="the guard's folder: with finished runs there, compare them without training "
        "(default: a fresh runs/regression-<time>-seed<s>-rounds<r>)",
    )
    add_cpu_only_device_argument(
        parser, "the recorded figures are CPU nodes' and server's; a GPU's differ in the last bits"
    )
    sweep.add_launcher_args(parser)
    args = parser.parse_args(argv)
    if args.seed < 0 or args.rounds < 1 or not args.tolerance >= 0:
        parser.error("--seed must be >= 0, --rounds >= 1 and --tolerance >= 0")
    if len(set(args.strategies)) < len(args.strategies):
        parser.error(f"--strategies must be distinct, got {args.strategies}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recorded = recorded_figures(args.results.read_text(), str(args.results))
    except (OSError, ValueError) as error:
        print(f"fedfields regression: {error}", file=sys.stderr)
        return 2
    out = (args.runs or default_out(args.seed, args.rounds)).resolve()
    status = sweep.main(sweep_argv(args, out))
    if status == 2:
        return 2
    plan = sweep.plan_sweep(sweep.parse_args(sweep_argv(args, out)))
    results = sweep.results_on_disk(plan)
    today = {
        strategy: results[f"strategy={strategy}"].get(args.seed, {}).get(METRIC)
        for strategy in args.strategies
    }
    comparisons = compare(recorded, today, args.seed, args.rounds)
    print(f"\nDemo regression guard ({METRIC}, runs in {out}):\n")
    print(table(comparisons, args.tolerance))
    moved = [c for c in comparisons if c.verdict(args.tolerance) != "same"]
    for c in moved:
        print(
            f"fedfields regression: {c.strategy} seed {c.seed}, {c.rounds} rounds: "
            f"{c.verdict(args.tolerance)}",
            file=sys.stderr,
        )
    return 1 if moved or status else 0


if __name__ == "__main__":
    sys.exit(main())
