"""The server job skeleton the ServerApp's jobs share: run directory, seeding, resume, observers,
metrics lines (also as TensorBoard events, `fedfields.tracking`), round checkpoints and the
final report.

`simulations.server_app.run_job` parses the run-config once into a `FederatedConfig` and
passes it down. A strategy job (the scene's `simulations.federated_nerf`, the meta tasks'
`simulations.meta_job`) supplies only its `RoundJob` parts: the strategy, the initial state,
the train config, its observers and a `StrategyReport` that scores each round;
`run_strategy_job` does the rest, handing each round's `RoundOutcome`
(`fedfields.flower.round`) to the report, the observers and the round checkpoint. The split
job (`simulations.split_job`), which has no strategy round loop, uses `new_run_dir`, `attach`
and `RunReport` around its own exchange loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, astuple, dataclass
from datetime import UTC, datetime
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import Tensor

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.flower import ProtocolStrategy
from fedfields.flower.protocol import NUM_FAILURES, NUM_MISSING, NUM_REPLIES, state_to_arrays
from fedfields.flower.resume import (
    RESUME_FILE,
    ResumeError,
    RoundCheckpoint,
    load_round_checkpoint,
    read_run_config,
    resumed_history,
    save_round_checkpoint,
)
from fedfields.flower.round import RoundLedger, RoundOutcome, journal_charge
from fedfields.flower.strategy import RoundEndFn, RoundLoop
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
    """The report of a strategy job: one line of metrics.jsonl per round's outcome and the
    final report; a job supplies its scoring, its headline and its final files (checkpoint).

    A line holds the round, the round's train metrics, the job's scores (`score_round`), the
    sampled and summed users, what the observers measured, the figures derived from all of
    them (`derived`) and the seconds since the start.
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

    def score_initial(self, arrays: ArrayRecord) -> None:
        """Before a fresh run's first round: what the job keeps of the initial state (nothing;
        nothing of it goes to metrics.jsonl)."""

    def score_round(self, outcome: RoundOutcome, arrays: ArrayRecord) -> dict[str, Any]:
        """The job's own figures of the round that ended in `outcome` with the global
        `arrays`, after its train metrics and before the observers'."""
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

    def end_round(self, outcome: RoundOutcome, arrays: ArrayRecord) -> None:
        """Score the round that ended in `outcome` with the global `arrays`: a line of
        metrics.jsonl, its observers shown the replies the round summed (the gate's)."""
        server_round = outcome.server_round
        metrics: dict[str, Any] = {"round": server_round, **outcome.metrics}
        metrics |= self.score_round(outcome, arrays)
        metrics |= round_users(outcome.ledger)
        metrics |= self.observe(server_round, arrays, outcome.ledger.summed_nodes)
        metrics |= self.derived(metrics)
        metrics["seconds"] = time.perf_counter() - self.started
        self.append_line(metrics)
        log(INFO, "fedfields round %d: %s", server_round, self.headline(metrics))

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


def reply_counts(metrics: dict[str, Any]) -> str:
    """A round's replies for its log line: "8 replies, 0 failures", plus ", 4 missing" when
    sampled nodes sent nothing before the timeout."""
    missing = int(metrics.get(NUM_MISSING, 0))
    counts = (
        f"{int(metrics.get(NUM_REPLIES, 0))} replies, {int(metrics.get(NUM_FAILURES, 0))} failures"
    )
    return counts + (f", {missing} missing" if missing else "")


def round_users(ledger: RoundLedger) -> dict[str, list[str]]:
    """The round's sampled users and the users whose replies its aggregate summed, by user
    key in the order they were summed (`fedfields.flower.strategy.UserKeys`)."""
    return {"users-sampled": list(ledger.users), "users-summed": ledger.summed_users}


@dataclass
class RoundJob:
    """What a strategy job supplies to `run_strategy_job`; the skeleton calls the builders in
    this order after opening the run directory: torch.manual_seed(seed), `initial_state`,
    `observers(run_dir)`, `report(run_dir, observers, initial state)`."""

    strategy: ProtocolStrategy
    train_config: ConfigRecord
    initial_state: Callable[[], dict[str, Tensor]]
    observers: Callable[[Path], list[Observer]]
    report: Callable[[Path, list[Observer], dict[str, Tensor]], StrategyReport]


def run_strategy_job(grid: Grid, config: FederatedConfig, job: RoundJob) -> Path:
    """Run `job`'s strategy on `grid` for run-config `num-server-rounds`, or resume it (run-config
    `resume`); returns the run directory holding the report.

    A plan beyond `dp-target-epsilon` (the `RoundLoop` a fresh run builds first), or MLflow
    asked for and not installed, fails before anything is written; the strategy's errors (no
    aggregate formed, the privacy budget spent) end the run as they are raised, the launch's
    event file closed.
    """
    strategy, num_rounds = job.strategy, config.common.num_server_rounds
    tracking = TrackingSettings.from_environ()
    loop = None if config.common.resume else RoundLoop(strategy, num_rounds)
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
        strategy.continue_after(checkpoint.server_round)
        charge_journal(run_dir, checkpoint.server_round, strategy)
        arrays = checkpoint.arrays()
        log(INFO, "fedfields: resuming %s after round %d", run_dir, checkpoint.server_round)
        loop = RoundLoop(strategy, num_rounds, checkpoint.server_round + 1)  # restored charges
    keep_journal(run_dir, strategy)
    assert loop is not None, "a fresh run builds its loop first, a resumed one from its checkpoint"
    with report.tracking(config, tracking, resumed_after):
        if checkpoint is None:
            report.score_initial(arrays)
        result = loop.run(
            attach(grid, observers),
            arrays,
            timeout=config.deployment.round_timeout,
            train_config=job.train_config,
            round_end_fn=round_end(report, run_dir, strategy),
        )
        summary = report.finish(result.arrays)
    log(INFO, "fedfields: secure aggregation %s", json.dumps(summary["secure-aggregation"]))
    log(INFO, "fedfields: final %s", json.dumps(summary["final"]))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir


DP_JOURNAL = "dp-journal.json"
"""A run directory's write-ahead record of noised sums released before their round was
charged (`RoundPrivacy.write_ahead`)."""


def keep_journal(run_dir: Path, strategy: ProtocolStrategy) -> None:
    """Have a DP strategy write its early releases to the run's journal, atomically."""
    if strategy.privacy is not None:
        strategy.privacy.journal = lambda entry: atomic.write_json(run_dir / DP_JOURNAL, entry)


def charge_journal(run_dir: Path, resumed_after: int, strategy: ProtocolStrategy) -> None:
    """Charge what the journal says a round past the checkpoint released before the crash
    (its noised sums left the server, its charge was never written), with a WARNING."""
    path = run_dir / DP_JOURNAL
    if strategy.privacy is None or not path.exists():
        return
    try:
        entry = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ResumeError(f"cannot resume {run_dir}: {DP_JOURNAL} is malformed: {error}") from None
    if int(entry.get("round", 0)) <= resumed_after or not entry.get("multipliers"):
        return
    try:
        charge = journal_charge(entry)
    except ValueError as error:
        raise ResumeError(f"cannot resume {run_dir}: {error}") from None
    accountant = strategy.privacy.accountant
    epsilon = accountant.charge(*astuple(charge))
    log(WARNING, "fedfields: round %d released noised sums before the run stopped; charged "
        "(z = %.4g): epsilon %.4g", entry["round"], charge.noise_multiplier, epsilon)  # fmt: skip


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
    if strategy.privacy is None:
        return {}
    return strategy.privacy.accountant.report()


def privacy_report(config: FederatedConfig, strategy: ProtocolStrategy) -> dict[str, Any]:
    """What the report says about client-level DP: off, or its settings, the form it took
    (central on plaintext sums, distributed under SecAgg+), the rounds charged and why the
    run stopped early, if it did."""
    dp = config.dp.dp_config()
    if dp is None or strategy.privacy is None:
        return {"enabled": False}
    secure = config.secure.secure_aggregation
    return {
        "enabled": True,
        "form": "distributed (clients noise before SecAgg+)" if secure else "central (server)",
        **asdict(dp),
        "rounds-charged": len(strategy.privacy.accountant.charges),
        "stopped": strategy.privacy.stop,
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


def round_end(report: StrategyReport, run_dir: Path, strategy: ProtocolStrategy) -> RoundEndFn:
    """The loop's round_end_fn: the report's line of the round's outcome, then the round's
    `RoundCheckpoint`, atomically."""

    def end(outcome: RoundOutcome, arrays: ArrayRecord) -> None:
        report.end_round(outcome, arrays)
        checkpoint = RoundCheckpoint.capture(outcome.server_round, arrays, strategy)
        save_round_checkpoint(run_dir / RESUME_FILE, checkpoint)

    return end
