"""The server job skeleton the ServerApp's jobs share: run directory, seeding, resume, observers,
metrics lines (also as TensorBoard events, `fedfields.tracking`), round checkpoints and the
final report.

`simulations.server_app.run_job` parses the run-config once into a `FederatedConfig` and
passes it down. A strategy job (the scene's `simulations.federated_nerf`, the meta tasks'
`simulations.meta_job`) supplies only its `RoundJob` parts: the strategy, the initial state,
the train config, its observers and a `StrategyReport` that scores each round; `run_rounds`
does the rest. The split job (`simulations.split_job`), which has no strategy round loop,
uses `new_run_dir`, `attach` and `RunReport` around its own exchange loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import Tensor

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.flower import ProtocolStrategy
from fedfields.flower.protocol import state_to_arrays
from fedfields.flower.resume import (
    RESUME_FILE,
    ResumeError,
    RoundCheckpoint,
    load_round_checkpoint,
    read_run_config,
    resumed_history,
    save_round_checkpoint,
)
from fedfields.report import write_report
from fedfields.tracking import RunTracker, TrackingSettings
from simulations.observers import Observer


class RunReport:
    """What every job writes into its run directory: a line of metrics.jsonl per round (or
    block of steps) with what the observers measured, and at the end summary.json, with the
    observers' final audits merged in, and report.html; while `tracking` is open, the lines
    and the final images also go to TensorBoard (and MLflow: `fedfields.tracking`)."""

    def __init__(self, run_dir: Path, observers: Sequence[Observer]) -> None:
        self.run_dir = run_dir
        self.observers = observers
        self.started = time.perf_counter()
        self.history: list[dict[str, Any]] = []
        self.tracker: RunTracker | None = None

    def tracking(
        self,
        config: FederatedConfig,
        settings: TrackingSettings,
        resumed_after: int | None = None,
    ) -> RunTracker:
        """Open this launch's tracker (`resumed_after`: the last round a resumed run keeps);
        use it in a `with`, which closes it on success and on error."""
        self.tracker = RunTracker(self.run_dir, config.to_run_config(), settings, resumed_after)
        return self.tracker

    def observe(
        self, server_round: int, arrays: ArrayRecord, accepted: Collection[int] = ()
    ) -> dict[str, Any]:
        """What the observers measured of round `server_round`'s global `arrays` and of the
        replies of the `accepted` nodes (the gate's; nothing else reaches an observer)."""
        observed: dict[str, Any] = {}
        for observer in self.observers:
            observed |= observer.observe_round(server_round, arrays, accepted)
        return observed

    def append_line(self, line: dict[str, Any]) -> None:
        """Keep `line` in the history, append it to metrics.jsonl and track it."""
        self.history.append(line)
        atomic.append_json_line(self.run_dir / "metrics.jsonl", line)
        if self.tracker is not None:
            self.tracker.log_line(line)

    def finish_observers(self, arrays: ArrayRecord, summary: dict[str, Any]) -> None:
        """Merge each observer's final audit into `summary`: its "final" into summary's."""
        for observer in self.observers:
            observed = observer.finish(arrays, self.history)
            if "final" in observed:
                summary["final"] |= observed.pop("final")
            summary |= observed

    def write(self, summary: dict[str, Any]) -> None:
        """summary.json, then report.html from the run directory's files; the run directory's
        images tracked."""
        atomic.write_json(self.run_dir / "summary.json", summary)
        write_report(self.run_dir)
        if self.tracker is not None:
            self.tracker.log_images()


class StrategyReport(RunReport):
    """Flower's evaluate_fn of a strategy job: one line of metrics.jsonl per round and the
    final report; a job supplies its scoring, its headline and its final files (checkpoint).

    A line holds the round, the job's scores (`score_round`), what the observers measured,
    the figures derived from both (`derived`) and the seconds since the start.
    """

    def __init__(
        self,
        config: FederatedConfig,
        run_dir: Path,
        strategy: ProtocolStrategy,
        observers: Sequence[Observer],
    ) -> None:
        super().__init__(run_dir, observers)
        self.config = config
        self.strategy = strategy

    def score_initial(self, arrays: ArrayRecord) -> dict[str, Any]:
        """Round 0's figures (the initial state), not written to metrics.jsonl."""
        return {"round": 0}

    def score_round(self, server_round: int, arrays: ArrayRecord) -> dict[str, Any]:
        """The job's own figures of round `server_round`, before the observers'."""
        raise NotImplementedError

    def derived(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Figures computed from the job's and the observers' (none by default)."""
        return {}

    def headline(self, metrics: dict[str, Any]) -> str:
        """The round's main figures for the log."""
        raise NotImplementedError

    def resuming(self, initial: dict[str, Tensor]) -> None:
        """Before a resumed run restores its RNGs: what round 0 would have scored (nothing)."""

    def summary_entries(self) -> dict[str, Any]:
        """summary.json's job-specific entries between the privacy settings and "final"."""
        return {}

    def final_scores(self, arrays: ArrayRecord) -> dict[str, Any]:
        """The job's final files (checkpoint, plots) and summary.json's "final" scores."""
        raise NotImplementedError

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Score round `server_round`; from round 1 append a line to metrics.jsonl."""
        if server_round == 0:
            return metric_record(self.score_initial(arrays))
        metrics = {"round": server_round, **self.score_round(server_round, arrays)}
        metrics |= round_users(self.strategy)
        latest = self.strategy.current_round
        accepted = latest.summed_nodes if latest and latest.server_round == server_round else []
        metrics |= self.observe(server_round, arrays, accepted)
        metrics |= self.derived(metrics)
        metrics["seconds"] = time.perf_counter() - self.started
        self.append_line(metrics)
        log(INFO, "fedfields round %d: %s", server_round, self.headline(metrics))
        return metric_record(metrics)

    def finish(self, arrays: ArrayRecord) -> dict[str, Any]:
        """The job's final files, the observers' final audits, summary.json and report.html."""
        summary: dict[str, Any] = {
            "seed": self.config.common.seed,
            "secure-aggregation": secure_aggregation_report(self.config),
            "differential-privacy": privacy_report(self.config, self.strategy),
            **self.summary_entries(),
            "final": self.final_scores(arrays) | privacy_final(self.strategy),
            "rounds": self.history,
        }
        self.finish_observers(arrays, summary)
        summary["seconds"] = time.perf_counter() - self.started
        self.write(summary)
        return summary


def round_users(strategy: ProtocolStrategy) -> dict[str, list[str]]:
    """The round's sampled users and the users whose replies its aggregate summed, by user
    key in the order they were summed (`fedfields.flower.user_keys`)."""
    train_round = strategy.current_round
    if train_round is None:
        return {}
    return {"users-sampled": list(train_round.users), "users-summed": train_round.summed_users}


def metric_record(metrics: dict[str, Any]) -> MetricRecord:
    """The scalar entries as floats (Flower's MetricRecord takes no None, strings or dicts)."""
    return MetricRecord(
        {key: float(value) for key, value in metrics.items() if isinstance(value, int | float)}
    )


@dataclass
class RoundJob:
    """What a strategy job supplies to `run_rounds`; the skeleton calls the builders in this
    order after opening the run directory: torch.manual_seed(seed), `initial_state`,
    `observers(run_dir)`, `report(run_dir, observers, initial state)`."""

    strategy: ProtocolStrategy
    train_config: ConfigRecord
    initial_state: Callable[[], dict[str, Tensor]]
    observers: Callable[[Path], list[Observer]]
    report: Callable[[Path, list[Observer], dict[str, Tensor]], StrategyReport]


def run_rounds(grid: Grid, config: FederatedConfig, job: RoundJob) -> Path:
    """Run `job`'s strategy on `grid` for run-config `num-server-rounds`, or resume it (run-config
    `resume`); returns the run directory holding the report.

    A plan beyond `dp-target-epsilon`, or MLflow asked for and not installed, fails before
    anything is written; the strategy's errors (no aggregate formed, the privacy budget spent)
    end the run as they are raised, the launch's event file closed.
    """
    strategy = job.strategy
    tracking = TrackingSettings.from_environ()
    if not config.common.resume:
        strategy.check_privacy_plan(1, config.common.num_server_rounds)
    run_dir, checkpoint = open_run_dir(config)
    torch.manual_seed(config.common.seed)
    initial = job.initial_state()
    if checkpoint is not None:  # the whole checkpoint, before any file is touched
        checkpoint.check(initial, strategy)
    observers = job.observers(run_dir)
    report = job.report(run_dir, observers, initial)
    arrays = state_to_arrays(initial)
    resumed_after = None if checkpoint is None else checkpoint.server_round
    if checkpoint is not None:
        report.resuming(initial)
        report.history = resumed_history(run_dir, checkpoint.server_round)
        checkpoint.restore(strategy)
        arrays = checkpoint.arrays()
        log(INFO, "fedfields: resuming %s after round %d", run_dir, checkpoint.server_round)
    with report.tracking(config, tracking, resumed_after):
        result = strategy.start(
            attach(grid, observers),
            arrays,
            num_rounds=config.common.num_server_rounds,
            timeout=config.deployment.round_timeout,
            train_config=job.train_config,
            evaluate_fn=report,
            first_round=1 if resumed_after is None else resumed_after + 1,
            round_end_fn=round_checkpointer(run_dir, strategy),
        )
        summary = report.finish(result.arrays)
    log(INFO, "fedfields: secure aggregation %s", json.dumps(summary["secure-aggregation"]))
    log(INFO, "fedfields: final %s", json.dumps(summary["final"]))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir


def attach(grid: Grid, observers: Sequence[Observer]) -> Grid:
    """`grid` wrapped by each observer in turn (`Observer.wrap_grid`)."""
    for observer in observers:
        grid = observer.wrap_grid(grid)
    return grid


def secure_aggregation_report(config: FederatedConfig) -> dict[str, Any]:
    """What the report says about secure aggregation: on or off, and its SecAgg+ settings."""
    secure = config.secure.secure_aggregation_config()
    if secure is None:
        return {"enabled": False}
    return {"enabled": True, "protocol": "Flower SecAgg+", **asdict(secure)}


def privacy_final(strategy: ProtocolStrategy) -> dict[str, float]:
    """summary.json's final "dp-epsilon" of a DP run, with its PLD and without-replacement
    figures (`DPAccountant.report`; {} without DP)."""
    if strategy.accountant is None:
        return {}
    return strategy.accountant.report()


def privacy_report(config: FederatedConfig, strategy: ProtocolStrategy) -> dict[str, Any]:
    """What the report says about client-level DP: off, or its settings, the form it took
    (central on plaintext sums, distributed under SecAgg+), the rounds charged and why the
    run stopped early, if it did."""
    dp = config.dp.dp_config()
    if dp is None or strategy.accountant is None:
        return {"enabled": False}
    secure = config.secure.secure_aggregation
    return {
        "enabled": True,
        "form": "distributed (clients noise before SecAgg+)" if secure else "central (server)",
        **asdict(dp),
        "rounds-charged": len(strategy.accountant.charges),
        "stopped": strategy.privacy_stop,
    }


def make_run_dir(config: FederatedConfig) -> Path:
    """The run directory: run-config's `run-dir`, else runs/<UTC time>-<strategy>."""
    if config.common.run_dir:
        path = Path(config.common.run_dir)
    else:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        path = Path.cwd() / "runs" / f"{stamp}-{config.strategy_name}"
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise FileExistsError(f"run directory {path} is not empty; pick a new run-dir")
    return path


def new_run_dir(config: FederatedConfig) -> Path:
    """A new, empty run directory (`make_run_dir`) holding the run's config.json."""
    run_dir = make_run_dir(config)
    atomic.write_json(run_dir / "config.json", config.to_run_config())
    return run_dir


def open_run_dir(config: FederatedConfig) -> tuple[Path, RoundCheckpoint | None]:
    """A new run directory (`new_run_dir`), or with run-config `resume` the run in `run-dir`
    and its last round checkpoint.

    Resuming checks that the saved config.json matches this run-config (secure-aggregation
    settings included) except `resume`, a larger `num-server-rounds` and the keys the run
    never reads, then keeps the lines of metrics.jsonl up to the checkpoint's round: a round
    the crash interrupted runs again.
    """
    if not config.common.resume:
        return new_run_dir(config), None
    run_dir = Path(config.common.run_dir)
    saved, current = read_run_config(run_dir), config.to_run_config()
    free = {"resume", "num-server-rounds"} | config.ignored_keys()
    differing = sorted(k for k in current.keys() - free if saved.get(k, current[k]) != current[k])
    if differing:
        changes = ", ".join(f"{k}: {saved[k]!r} -> {current[k]!r}" for k in differing)
        raise ResumeError(f"cannot resume {run_dir}: run-config differs from the run's ({changes})")
    checkpoint = load_round_checkpoint(run_dir / RESUME_FILE)
    if checkpoint.server_round > config.common.num_server_rounds:
        raise ResumeError(
            f"cannot resume {run_dir}: it completed {checkpoint.server_round} rounds, more than "
            f"num-server-rounds = {config.common.num_server_rounds}"
        )
    return run_dir, checkpoint


def round_checkpointer(
    run_dir: Path, strategy: ProtocolStrategy
) -> Callable[[int, ArrayRecord], None]:
    """`ProtocolStrategy.start`'s round_end_fn: the round's `RoundCheckpoint`, atomically."""

    def save(server_round: int, arrays: ArrayRecord) -> None:
        checkpoint = RoundCheckpoint.capture(server_round, arrays, strategy)
        save_round_checkpoint(run_dir / RESUME_FILE, checkpoint)

    return save
