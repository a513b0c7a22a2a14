"""The federated NeRF job a ServerApp runs: strategy, rounds, per-round report, run directory.

The server starts from run-config alone: the global field's shapes come from it, and it reads
no user's file. Per-round figures come from the clients (their train metrics and their score
of the received global field on their own held-out views, aggregated like any metric, through
SecAgg+ when secure aggregation is on) and, optionally, from the server's own renders of a
public clean scene (`eval-scene-dir`). What needs the users' ground truth is a simulation-only
observer (`simulations.scene_observer`) that the simulation attaches.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data import Scene, load_scene
from fedfields.data.crowd import CrowdData
from fedfields.flower import ProtocolStrategy
from fedfields.flower.protocol import NUM_REPLIES, arrays_to_state, state_to_arrays
from fedfields.flower.resume import (
    RESUME_FILE,
    ResumeError,
    RoundCheckpoint,
    load_round_checkpoint,
    read_run_config,
    resumed_history,
    save_round_checkpoint,
)
from fedfields.privacy.dp import EPSILON_METRIC
from fedfields.render.orbit import ORBIT_FILE, write_gif
from fedfields.report import write_report
from fedfields.train import save_checkpoint
from fedfields.train.builders import global_field, render_config
from fedfields.train.evaluation import FieldRenderer
from fedfields.train.federated import federated_state
from simulations.observers import Observer, simulation_observed
from simulations.scene_observer import CrowdObserver
from strategies import make_strategy as make_named_strategy


class RoundReport:
    """Flower's evaluate_fn: one line of metrics.jsonl per round, and the final report.

    A line holds the clients' aggregated train metrics, the round's cost, the server's score
    on the public `eval-scene-dir` (if given) and what the observers measured.
    """

    def __init__(
        self,
        config: FederatedConfig,
        run_dir: Path,
        strategy: ProtocolStrategy,
        observers: list[Observer],
        num_parameters: int,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.strategy = strategy
        self.observers = observers
        self.num_parameters = num_parameters
        self.renderer = FieldRenderer(config)
        self.eval_scene: Scene | None = None
        if config.common.eval_scene_dir:
            self.eval_scene = load_scene(
                config.common.eval_scene_dir, downscale=config.common.downscale
            )
        self.started = time.perf_counter()
        self.history: list[dict[str, Any]] = []

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Record round `server_round`; round 0 (the random initial field) is not scored."""
        if server_round == 0:
            return MetricRecord({"round": 0.0})
        train = dict(self.strategy.latest_train_metrics)
        clients = int(train.get(NUM_REPLIES, 0))
        cost = self.strategy.cost_model.round_cost(self.num_parameters, clients)
        metrics: dict[str, Any] = {
            "round": server_round,
            **train,
            "server-flops": float(cost.server_flops),
            "uplink-bytes": float(cost.uplink_bytes),
            "downlink-bytes": float(cost.downlink_bytes),
        }
        if self.eval_scene is not None:
            self.renderer.load(arrays_to_state(arrays))
            views = range(min(len(self.eval_scene), self.config.scene.eval_views_per_round))
            metrics["eval-scene-psnr"] = self.renderer.score_scene(self.eval_scene, views)[0]
        for observer in self.observers:
            metrics |= observer.observe_round(server_round, arrays)
        metrics["seconds"] = time.perf_counter() - self.started
        self.history.append(metrics)
        atomic.append_json_line(self.run_dir / "metrics.jsonl", metrics)
        log(INFO, "fedfields round %d: %s", server_round, _headline(metrics))
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    def finish(self, arrays: ArrayRecord) -> dict[str, Any]:
        """Checkpoint of the global field, the server's final scores, summary.json and
        report.html."""
        self.renderer.load(arrays_to_state(arrays))
        final: dict[str, Any] = {}
        if self.eval_scene is not None:
            scene = self.eval_scene
            final["eval-scene-psnr"], final["eval-scene-ssim"] = self.renderer.score_scene(
                scene, range(len(scene))
            )
        metadata = {"strategy": self.config.strategy_name}
        save_checkpoint(
            self.run_dir / "checkpoint.pt",
            self.renderer.field,
            render_config(self.config, self.eval_scene),
            self.renderer.occupancy,
            metadata,
        )
        write_gif(self.run_dir / ORBIT_FILE, self.renderer.orbit())
        final |= privacy_final(self.strategy)
        summary: dict[str, Any] = {
            "secure-aggregation": secure_aggregation_report(self.config),
            "differential-privacy": privacy_report(self.config, self.strategy),
            "final": final,
            "rounds": self.history,
        }
        for observer in self.observers:
            observed = observer.finish(arrays, self.history)
            summary["final"] |= observed.pop("final", {})
            summary |= observed
        summary["seconds"] = time.perf_counter() - self.started
        atomic.write_json(self.run_dir / "summary.json", summary)
        write_report(self.run_dir)
        return summary


def _headline(metrics: dict[str, Any]) -> str:
    """The round's main figures for the log."""
    keys = (
        "train-psnr",
        "client-eval-psnr",
        "eval-scene-psnr",
        "clean-psnr",
        "personal-psnr",
        "personal-psnr-floor",
    )
    shown = [f"{key} {metrics[key]:.2f} dB" for key in keys if key in metrics]
    failures = int(metrics.get("num-failures", 0))
    replies = int(metrics.get(NUM_REPLIES, 0))
    return ", ".join([*shown, f"{replies} replies, {failures} failures"])


def secure_aggregation_report(config: FederatedConfig) -> dict[str, Any]:
    """What the report says about secure aggregation: on or off, and its SecAgg+ settings."""
    secure = config.secure.secure_aggregation_config()
    if secure is None:
        return {"enabled": False}
    return {"enabled": True, "protocol": "Flower SecAgg+", **asdict(secure)}


def privacy_final(strategy: ProtocolStrategy) -> dict[str, float]:
    """summary.json's final "dp-epsilon" of a DP run ({} without DP)."""
    if strategy.accountant is None:
        return {}
    return {EPSILON_METRIC: strategy.accountant.epsilon()}


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


def make_strategy(config: FederatedConfig) -> ProtocolStrategy:
    """The strategy named by run-config, sampling `fraction-train` of the connected nodes."""
    return make_named_strategy(
        config.strategy_name,
        config.to_run_config(),
        fraction_train=config.scene.fraction_train,
        min_train_nodes=config.deployment.min_train_nodes,
        min_available_nodes=max(
            config.deployment.min_available_nodes, config.deployment.min_train_nodes
        ),
        fraction_evaluate=0.0,  # clients score the global field inside their train reply
        secure_aggregation=config.secure.secure_aggregation_config(),
        node_timeout=config.deployment.round_timeout,
        sampling_seed=config.common.seed,
        differential_privacy=config.dp.dp_config(),
    )


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


def open_run_dir(config: FederatedConfig) -> tuple[Path, RoundCheckpoint | None]:
    """A new, empty run directory (config.json written), or with run-config `resume` the run
    in `run-dir` and its last round checkpoint.

    Resuming checks that the saved config.json matches this run-config (secure-aggregation
    settings included) except `resume`, a larger `num-server-rounds` and the keys the run
    never reads, then keeps the lines of metrics.jsonl up to the checkpoint's round: a round
    the crash interrupted runs again.
    """
    if not config.common.resume:
        run_dir = make_run_dir(config)
        atomic.write_json(run_dir / "config.json", config.to_run_config())
        return run_dir, None
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


def run_federated_nerf(grid: Grid, run_config: dict[str, Any], observe: bool | None = None) -> Path:
    """Run the whole job on `grid`; returns the run directory holding the report.

    `observe` attaches the simulation-only crowd audit (it reads run-config `data-dir`); None
    attaches it when a simulation launcher set run-config `simulation-audit`.
    """
    config = FederatedConfig.from_run_config(run_config)
    if observe is None:
        observe = simulation_observed(run_config)
    crowd = CrowdData.load(config.deployment.data_dir, config.common.downscale) if observe else None
    strategy = make_strategy(config)  # an unknown strategy fails before anything is written
    if not config.common.resume:  # a plan beyond dp-target-epsilon, too
        strategy.check_privacy_plan(1, config.common.num_server_rounds)
    run_dir, checkpoint = open_run_dir(config)
    torch.manual_seed(config.common.seed)
    initial = state_to_arrays(federated_state(global_field(config)))
    observers: list[Observer] = [] if crowd is None else [CrowdObserver(config, crowd, run_dir)]
    for observer in observers:
        grid = observer.wrap_grid(grid)
    num_parameters = sum(int(np.prod(array.shape)) for array in initial.values())
    report = RoundReport(config, run_dir, strategy, observers, num_parameters)
    if checkpoint is not None:
        report.history = resumed_history(run_dir, checkpoint.server_round)
        checkpoint.restore(strategy)
        initial = checkpoint.arrays()
        log(INFO, "fedfields: resuming %s after round %d", run_dir, checkpoint.server_round)
    result = strategy.start(
        grid,
        initial,
        num_rounds=config.common.num_server_rounds,
        timeout=config.deployment.round_timeout,
        train_config=ConfigRecord({"local-steps": config.scene.local_steps}),
        evaluate_fn=report,
        first_round=1 if checkpoint is None else checkpoint.server_round + 1,
        round_end_fn=round_checkpointer(run_dir, strategy),
    )
    summary = report.finish(result.arrays)
    log(INFO, "fedfields: secure aggregation %s", json.dumps(summary["secure-aggregation"]))
    log(INFO, "fedfields: final %s", json.dumps(summary["final"]))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir
