"""`python -m simulations.sweep`: a grid of run-configs times seeds, each run by the launcher
(`python -m simulations.launch`), then one table of their final metrics over seeds.

The run of setting `name` at seed `s` is `<sweep-dir>/<name>/seed-<s>` (its node state beside it
in `seed-<s>.nodes`, its launcher output in `seed-<s>.log`), launched with that `--run-dir` and
`--run-config "<setting> seed=<s> <base run-config>"` plus the launcher flags given after `--`.
Every setting is checked up front by the launcher's own validation (`planner.job_config`), so
a typo stops the sweep before anything runs. A rerun of the same command skips the runs whose
summary.json is complete, resumes a killed run from its round checkpoint (`--resume`) and
restarts one without a checkpoint cleanly. The tables (table.md, table.csv, pairs.csv) hold
mean ± sample std per setting and metric, and for each `--pair A B` the per-seed A − B with a
95% Student-t interval (`simulations.sweep_statistics`); `--table-only` rebuilds them from the runs
on disk. The exit status is 1 when a run failed (the others still run), 2 for a bad sweep;
Ctrl-C or SIGTERM stops the running launchers (each stops what it started) and starts no more.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import click
from flwr.common.config import parse_config_args
from tqdm import tqdm

from fedfields import atomic
from fedfields.config.schema import section_of_keys
from fedfields.flower.resume import CONFIG_FILE, RESUME_FILE
from simulations import APP_DIR, launch
from simulations.planner import (
    ENVIRONMENT,
    DataOptions,
    as_run_config,
    job_config,
    plan_nodes,
    server_error,
)
from simulations.sweep_statistics import (
    PAIR_HEADER,
    RunValue,
    csv_text,
    expand_grid,
    final_metrics,
    is_complete,
    pair_csv_rows,
    pair_markdown,
    pair_stats,
    parse_grid,
    setting_csv,
    setting_markdown,
    setting_names,
    setting_stats,
    typed,
)

LAUNCHER = (sys.executable, "-m", "simulations.launch")
SWEEP_FLAGS = ("--run-dir", "--run-config", "--resume")
"""Launcher flags the sweep sets itself for every run."""
STOP_POLL_SECONDS = 0.5
SWEEP_KEYS = ("seed", "run-dir", "resume")
"""Run-config keys the sweep sets itself (`--seeds`, the run's folder, a resumed run)."""


@dataclass(frozen=True)
class Run:
    """One launcher run: a setting at a seed, in its own run directory."""

    setting: str
    seed: int
    run_dir: Path
    run_config: str

    @property
    def label(self) -> str:
        """`<setting>/seed-<s>`, as the progress lines name it."""
        return f"{self.setting}/seed-{self.seed}"

    @property
    def log(self) -> Path:
        """The launcher's output, beside the run directory (which must start empty)."""
        return self.run_dir.with_name(self.run_dir.name + ".log")

    @property
    def state_dir(self) -> Path:
        """The nodes' private state the launcher keeps beside the run directory."""
        return self.run_dir.with_name(self.run_dir.name + ".nodes")


@dataclass(frozen=True)
class SweepPlan:
    """A checked sweep: its folder, settings (in grid order), runs, launcher and pairs."""

    sweep_dir: Path
    settings: tuple[str, ...]
    seeds: tuple[int, ...]
    runs: tuple[Run, ...]
    base_run_config: str
    launcher_args: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]
    parallel: int
    launcher: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    """How a launched run ended: its exit status and, when it failed, its last error line."""

    run: Run
    returncode: int
    error: str = ""

    @property
    def failed(self) -> bool:
        """Whether the run did not finish (a non-zero exit or no complete summary.json)."""
        return bool(self.error)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The sweep's flags; the launcher's own come after `--`."""
    parser = argparse.ArgumentParser(
        prog="python -m simulations.sweep",
        description="Run a grid of run-configs times seeds through `python -m simulations.launch` "
        "and tabulate the final metrics (mean ± std over seeds, paired differences).",
    )
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=[V1, V2]",
        help="a run-config key and its values (TOML or Python list); several: their product",
    )
    parser.add_argument("--run-config", default="", help="run-config every run shares")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="run-config seeds")
    parser.add_argument("--parallel", type=int, default=1, help="launcher runs at once")
    parser.add_argument(
        "--sweep-dir",
        type=Path,
        default=None,
        help="default runs/sweep-<hash of the settings and launcher flags>",
    )
    parser.add_argument(
        "--pair",
        nargs=2,
        action="append",
        default=[],
        metavar=("A", "B"),
        help="two setting names (e.g. strategy=decentnerf strategy=fedavg): A − B per seed",
    )
    parser.add_argument(
        "--table-only", action="store_true", help="rebuild the tables from the runs on disk"
    )
    add_launcher_args(parser)
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}")
    return args


def add_launcher_args(parser: argparse.ArgumentParser) -> None:
    """The launcher's own flags after `--`, passed to every run (`launcher_args`)."""
    parser.add_argument(
        "launcher_args",
        nargs="*",
        metavar="-- LAUNCHER_FLAGS",
        help="flags for every `python -m simulations.launch` run, e.g. -- --users 4 --no-audit",
    )


def run_config_values(text: str) -> dict[str, RunValue]:
    """`--run-config` text as typed values; ValueError naming the text when it is malformed."""
    if not text.strip():
        return {}
    try:
        return parse_config_args([text])
    except click.ClickException as error:
        raise ValueError(f"--run-config {text!r}: {error.message}") from None


def checked_settings(
    grids: Sequence[str], base: dict[str, RunValue], seed: int
) -> tuple[list[str], list[dict[str, RunValue]]]:
    """The grid's settings (values typed as their keys are declared) and names, each checked
    with `base` and `seed` by the launcher's `job_config`; ValueError naming the setting."""
    parsed = [parse_grid(text) for text in grids]
    declared = {key: type(field.default) for key, (_, field) in section_of_keys().items()}
    for key, _ in parsed:
        if key in SWEEP_KEYS:
            raise ValueError(f"--grid {key}: the sweep sets {key!r} itself (seeds: --seeds)")
        if key in base:
            raise ValueError(f"run-config {key!r} is both in --grid and in --run-config")
    grid = [(key, [typed(v, declared.get(key, object)) for v in values]) for key, values in parsed]
    settings = expand_grid(grid)
    names = setting_names(settings)
    for name, values in zip(names, settings, strict=True):
        try:
            job_config(as_run_config({**values, "seed": seed, **base}))
        except ValueError as error:
            raise ValueError(f"setting {name}: {error}") from None
    return names, settings


def checked_launcher_args(launcher_args: Sequence[str]) -> None:
    """The launcher flags must be the launcher's (its parser exits naming a bad one) and leave
    the run directory, run-config and resuming to the sweep."""
    for word in launcher_args:
        if word.split("=", 1)[0] in SWEEP_FLAGS:
            raise ValueError(f"launcher flag {word.split('=', 1)[0]}: the sweep sets it per run")
    launch.parse_args(list(launcher_args))


def default_sweep_dir(
    settings: Sequence[dict[str, RunValue]], base: str, flags: Sequence[str]
) -> Path:
    """runs/sweep-<hash>: the same settings, base run-config and launcher flags give the same
    folder, so rerunning a command resumes its sweep (more seeds extend it)."""
    key = json.dumps([list(map(list, (s.items() for s in settings))), base, list(flags)])
    return APP_DIR / "runs" / f"sweep-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def plan_sweep(args: argparse.Namespace) -> SweepPlan:
    """The sweep `args` ask for, every setting and flag checked; ValueError naming the first
    bad key, value, setting or pair (the launcher's parser exits on a flag it lacks)."""
    base = run_config_values(args.run_config)
    for key in SWEEP_KEYS:
        if key in base:
            raise ValueError(f"--run-config {key}: the sweep sets {key!r} itself (seeds: --seeds)")
    if len(set(args.seeds)) < len(args.seeds) or min(args.seeds) < 0:
        raise ValueError(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    names, settings = checked_settings(args.grid, base, args.seeds[0])
    checked_launcher_args(args.launcher_args)
    for pair in args.pair:
        unknown = [name for name in pair if name not in names]
        if unknown or pair[0] == pair[1]:
            raise ValueError(
                f"--pair {' '.join(pair)}: name two different settings of this sweep: "
                f"{', '.join(names)}"
            )
    sweep_dir = (
        args.sweep_dir or default_sweep_dir(settings, args.run_config, args.launcher_args)
    ).resolve()
    runs = tuple(
        Run(name, seed, sweep_dir / name / f"seed-{seed}",
            as_run_config({**values, "seed": seed, **base}))
        for name, values in zip(names, settings, strict=True)
        for seed in args.seeds
    )  # fmt: skip
    return SweepPlan(
        sweep_dir=sweep_dir,
        settings=tuple(names),
        seeds=tuple(args.seeds),
        runs=runs,
        base_run_config=args.run_config,
        launcher_args=tuple(args.launcher_args),
        pairs=tuple((a, b) for a, b in args.pair),
        parallel=args.parallel,
        launcher=LAUNCHER,
    )


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json when it is a finished run's (`is_complete`), else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if is_complete(summary) else None


def launch_command(plan: SweepPlan, run: Run) -> tuple[list[str], str]:
    """The launcher command for an unfinished run and what it does: resume a killed run from
    its round checkpoint, else start afresh (a partial run's folders removed first)."""
    if (run.run_dir / RESUME_FILE).is_file() and (run.run_dir / CONFIG_FILE).is_file():
        command = [*plan.launcher, "--resume", str(run.run_dir), *plan.launcher_args]
        return command, f"resuming {run.run_dir} from its last round checkpoint ({RESUME_FILE})"
    command = [*plan.launcher, "--run-dir", str(run.run_dir), "--run-config", run.run_config]
    command += plan.launcher_args
    if run.run_dir.exists() or run.state_dir.exists():
        shutil.rmtree(run.run_dir, ignore_errors=True)
        shutil.rmtree(run.state_dir, ignore_errors=True)
        return (
            command,
            f"restarting {run.run_dir} cleanly: the unfinished run left no {RESUME_FILE}",
        )
    return command, f"starting {run.run_dir}"


def last_error_line(output: str) -> str:
    """The run's error as the launcher's output names it: its last `...Error: message` line,
    else its last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return server_error(output) or (lines[-1] if lines else "no output")


def wait_or_stop(process: subprocess.Popen[bytes], stop: threading.Event) -> int:
    """`process`'s exit status; once `stop` is set, after a SIGTERM (a launcher then stops
    everything it started)."""
    while process.poll() is None:
        if stop.wait(STOP_POLL_SECONDS):
            process.terminate()
            return process.wait()
    return process.returncode


def execute(plan: SweepPlan, run: Run, note: tqdm, stop: threading.Event) -> Outcome:
    """Launch `run` with its output appended to its log file; its outcome."""
    run.run_dir.parent.mkdir(parents=True, exist_ok=True)
    command, action = launch_command(plan, run)
    note.write(f"fedfields sweep: {run.label}: {action}")
    with run.log.open("a") as log:
        start = log.tell()
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        log.write(f"=== fedfields sweep {stamp}: {action}\n$ {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(
            command, cwd=APP_DIR, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        returncode = wait_or_stop(process, stop)
    if returncode == 0 and read_summary(run.run_dir) is not None:
        return Outcome(run, 0)
    with run.log.open() as log:
        log.seek(start)
        output = log.read()
    error = last_error_line(output) if returncode else "exit 0 without a complete summary"
    return Outcome(run, returncode, error)


@contextmanager
def locked(sweep_dir: Path) -> Iterator[None]:
    """Hold the sweep folder's lock: a second sweep in the same folder stops at once."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with (sweep_dir / ".sweep.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another sweep is running in {sweep_dir}") from None
        yield


def prepare_datasets(plan: SweepPlan, runs: Sequence[Run]) -> None:
    """Build the datasets of `runs`' settings (crowd, object collection, shared-client links)
    once, as their launcher would: launches side by side would each build the same folder."""
    options = launch.parse_args(list(plan.launcher_args))
    env = {**os.environ, **ENVIRONMENT}
    for run in {run.setting: run for run in runs}.values():
        config = job_config(run.run_config)
        plan_nodes(config, DataOptions.from_args(options), env, clients=options.clients)


def run_sweep(plan: SweepPlan) -> list[Outcome]:
    """Launch every unfinished run of the sweep, holding its folder's lock; their outcomes."""
    with locked(plan.sweep_dir):
        pending = [run for run in plan.runs if read_summary(run.run_dir) is None]
        prepare_datasets(plan, pending)
        return launch_all(plan, pending)


def launch_all(plan: SweepPlan, pending: Sequence[Run]) -> list[Outcome]:
    """Launch `pending`, `plan.parallel` at a time, under one progress bar over the whole sweep;
    their outcomes, each reported as it ends."""
    finished = len(plan.runs) - len(pending)
    outcomes, stop = [], threading.Event()
    with (
        tqdm(total=len(plan.runs), initial=finished, unit="run", desc="sweep") as bar,
        ThreadPoolExecutor(max_workers=plan.parallel) as pool,
    ):
        bar.write(f"fedfields sweep: {plan.sweep_dir}: {finished} of {len(plan.runs)} runs done")
        started = time.perf_counter()
        futures = [pool.submit(execute, plan, run, bar, stop) for run in pending]
        try:
            for future in as_completed(futures):
                outcomes.append(outcome := future.result())
                bar.update(1)
                bar.write(outcome_line(outcome, time.perf_counter() - started))
        except BaseException:  # Ctrl-C, SIGTERM: stop the launchers running, start no more
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
    return outcomes


def outcome_line(outcome: Outcome, seconds: float) -> str:
    """The terminal's line for a run that ended: finished, or failed with its error and log."""
    run = outcome.run
    if outcome.failed:
        return (
            f"fedfields sweep: {run.label} FAILED (exit {outcome.returncode}): {outcome.error} "
            f"[log: {run.log}]"
        )
    return f"fedfields sweep: {run.label} finished ({seconds:.0f} s into the sweep)"


def results_on_disk(plan: SweepPlan) -> dict[str, dict[int, dict[str, float]]]:
    """The final metrics of every finished run: results[setting][seed][metric]."""
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in plan.settings}
    for run in plan.runs:
        summary = read_summary(run.run_dir)
        if summary is not None:
            results[run.setting][run.seed] = final_metrics(summary)
    return results


def write_tables(plan: SweepPlan) -> str:
    """table.md, table.csv and (with pairs) pairs.csv from the runs on disk, each written
    atomically; returns the markdown."""
    results = results_on_disk(plan)
    done = sum(len(runs) for runs in results.values())
    stats = setting_stats(results)
    markdown = [
        f"# Sweep {plan.sweep_dir.name}\n\n",
        f"Settings: {len(plan.settings)}, seeds: {list(plan.seeds)}; {done} of {len(plan.runs)} "
        f"runs finished. Base run-config: `{plan.base_run_config or 'none'}`; launcher flags: "
        f"`{shlex.join(plan.launcher_args) or 'none'}`.\n\n",
        "## Final metrics (mean ± sample std over seeds)\n\n",
        setting_markdown(stats),
    ]
    pair_rows = []
    if plan.pairs:
        markdown.append("\n## Paired differences (A − B per seed, 95% Student-t interval)\n")
    for a, b in plan.pairs:
        found = pair_stats(a, b, results)
        markdown.append("\n" + pair_markdown(a, b, found))
        pair_rows += pair_csv_rows(a, b, found)
    atomic.write_text(plan.sweep_dir / "table.csv", setting_csv(stats))
    if plan.pairs:
        atomic.write_text(plan.sweep_dir / "pairs.csv", csv_text(PAIR_HEADER, pair_rows))
    text = "".join(markdown)
    atomic.write_text(plan.sweep_dir / "table.md", text)
    return text


def _terminate(signum: int, _: FrameType | None) -> None:
    """SIGTERM: leave like Ctrl-C, through `launch_all`'s stop of the running launchers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = plan_sweep(args)
        if args.table_only and not plan.sweep_dir.is_dir():
            raise ValueError(f"--table-only: no sweep in {plan.sweep_dir}")
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            outcomes = [] if args.table_only else run_sweep(plan)
        finally:
            signal.signal(signal.SIGTERM, previous)
    except ValueError as error:
        print(f"fedfields sweep: {error}", file=sys.stderr)
        return 2
    print(write_tables(plan))
    print(f"fedfields sweep: tables in {plan.sweep_dir} (table.md, table.csv)")
    failed = [outcome for outcome in outcomes if outcome.failed]
    for outcome in failed:
        print(
            f"fedfields sweep: {outcome.run.label} failed (exit {outcome.returncode}): "
            f"{outcome.error}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
