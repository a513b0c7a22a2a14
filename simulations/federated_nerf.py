"""The federated NeRF job a ServerApp runs: strategy, initial field, per-round scoring.

The server starts from run-config alone: the global field's shapes come from it, and it reads
no user's file. Per-round figures come from the clients (their train metrics and their score
of the received global field on their own held-out views, aggregated like any metric, through
SecAgg+ when secure aggregation is on) and, optionally, from the server's own renders of a
public clean scene (`eval-scene-dir`). What needs the users' ground truth is a simulation-only
observer (`simulations.scene_observer`) that the simulation attaches. The run directory,
seeding, resume, metrics lines and summary are the job skeleton's (`simulations.job`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.config import FederatedConfig
from fedfields.data import Scene, load_scene
from fedfields.data.crowd import CrowdData
from fedfields.flower import ProtocolStrategy
from fedfields.flower.protocol import NUM_REPLIES
from fedfields.flower.round import RoundOutcome
from fedfields.render.orbit import ORBIT_FILE, write_gif
from fedfields.train import save_checkpoint
from fedfields.train.builders import global_field, render_config, splat_relocation
from fedfields.train.federated import federated_state
from simulations.job import RoundJob, StrategyReport, reply_counts, run_strategy_job
from simulations.observers import Observer
from simulations.scene_observer import CrowdObserver, GlobalRenderer
from strategies import make_strategy as make_registered_strategy


class RoundReport(StrategyReport):
    """The scene job's report (`StrategyReport`): a line holds the clients'
    aggregated train metrics, the round's cost, the server's score on the public
    `eval-scene-dir` (if given) and what the observers measured; at the end the global
    field's checkpoint, its orbit and the server's final scores.
    """

    def __init__(
        self,
        config: FederatedConfig,
        run_dir: Path,
        strategy: ProtocolStrategy,
        observers: list[Observer],
        num_parameters: int,
        global_field: GlobalRenderer,
    ) -> None:
        super().__init__(config, run_dir, strategy, observers)
        self.num_parameters = num_parameters
        self.global_field = global_field
        self.eval_scene: Scene | None = None
        if config.common.eval_scene_dir:
            self.eval_scene = load_scene(
                config.common.eval_scene_dir, downscale=config.common.downscale
            )

    def score_round(self, outcome: RoundOutcome, arrays: ArrayRecord) -> dict[str, Any]:
        """The round's cost and the public scene's PSNR."""
        clients = int(outcome.metrics.get(NUM_REPLIES, 0))
        cost = self.strategy.cost_model.round_cost(self.num_parameters, clients)
        metrics: dict[str, Any] = {
            "server-flops": float(cost.server_flops),
            "uplink-bytes": float(cost.uplink_bytes),
            "downlink-bytes": float(cost.downlink_bytes),
        }
        if self.eval_scene is not None:
            renderer = self.global_field.at(outcome.server_round, arrays)
            views = range(min(len(self.eval_scene), self.config.scene.eval_views_per_round))
            metrics["eval-scene-psnr"] = renderer.score_scene(self.eval_scene, views)["psnr"]
        return metrics

    def headline(self, metrics: dict[str, Any]) -> str:
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
        return ", ".join([*shown, reply_counts(metrics)])

    def final_scores(self, arrays: ArrayRecord) -> dict[str, Any]:
        """Checkpoint and orbit (run-config orbit-frames) of the global field; its scores on the
        public scene."""
        renderer = self.global_field.at("final", arrays)
        final: dict[str, Any] = {}
        if self.eval_scene is not None:
            scene = self.eval_scene
            scores = renderer.score_scene(scene, range(len(scene)), perceptual=True)
            final |= {f"eval-scene-{name}": value for name, value in scores.items()}
        metadata = {"strategy": self.config.strategy_name}
        save_checkpoint(
            self.run_dir / "checkpoint.pt",
            renderer.field,
            render_config(self.config, self.eval_scene),
            renderer.occupancy,
            metadata,
        )
        if self.config.scene.orbit_frames:
            write_gif(self.run_dir / ORBIT_FILE, renderer.orbit(self.config.scene.orbit_frames))
        return final


def make_strategy(config: FederatedConfig) -> ProtocolStrategy:
    """The strategy named by run-config, sampling `fraction-train` of the connected nodes; a
    splat field's relocation (`splat-relocate-every`) refines each round's global."""
    return make_registered_strategy(
        config,
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
        compression=config.compression.compression_config(),
        refine_global=splat_relocation(config),
    )


def run_federated_nerf(grid: Grid, config: FederatedConfig, observe: bool | None = None) -> Path:
    """Run the whole job on `grid` (`simulations.job.run_strategy_job`); returns the run directory.

    `observe` attaches the simulation-only crowd audit (it reads run-config `data-dir`); None
    attaches it when a simulation launcher set run-config `simulation-audit`.
    """
    if observe is None:
        observe = config.deployment.simulation_audit
    crowd = CrowdData.load(config.deployment.data_dir, config.common.downscale) if observe else None
    renders: list[GlobalRenderer] = []  # the run's one, built after the job seeds torch

    def observers(run_dir: Path) -> list[Observer]:
        renders.append(GlobalRenderer(config))
        return [] if crowd is None else [CrowdObserver(config, crowd, run_dir, renders[0])]

    def report(run_dir: Path, audits: list[Observer], initial: dict[str, Tensor]) -> RoundReport:
        num_parameters = sum(tensor.numel() for tensor in initial.values())
        return RoundReport(config, run_dir, job.strategy, audits, num_parameters, renders[0])

    job = RoundJob(
        strategy=make_strategy(config),  # an unknown strategy fails before anything is written
        train_config=ConfigRecord({"local-steps": config.scene.local_steps}),
        initial_state=lambda: federated_state(global_field(config)),
        observers=observers,
        report=report,
    )
    return run_strategy_job(grid, config, job)
