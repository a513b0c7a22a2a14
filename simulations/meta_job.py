"""The FedMeNF job a ServerApp runs for task faces, photos, video or objects: strategy, rounds,
report.

The server starts from run-config alone and holds no client's data. Each round it writes the
clients' aggregated train metrics (loss, gamma, replies, failures, traffic) and scores the
global meta-learner theta by test-time optimisation (TTO) on public held-out tasks no client
holds: PSNR/SSIM (LPIPS where available) of the query set after 0, 1, 2, 4, ... `tto-steps`
steps on the support set. Faces and video take their held-out tasks from scikit-image's
data; objects from run-config `eval-scene-dir` (without it the server skips TTO).

PSNR_p (FedMeNF Eq. 6) needs the clients' private query images, so it is measured by the
simulation-only observer `simulations.meta_observer.PrivacyAudit`, which `meta_observers`
attaches when a simulation launcher sets run-config `simulation-audit`. The run directory,
seeding, resume, metrics lines and summary are the job skeleton's (`simulations.job`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from matplotlib.figure import Figure
from torch import Tensor

from fedfields import atomic
from fedfields.config import FederatedConfig, MetaSettings, meta_round_sizes, meta_settings
from fedfields.flower import FedMeNF, ProtocolStrategy, StrategyOptions, m_of_n_sampling
from fedfields.flower.fedmenf import GAMMA
from fedfields.flower.protocol import (
    LOCAL_STEPS,
    TRAIN_LOSS,
    arrays_to_state,
)
from fedfields.flower.round import RoundOutcome
from fedfields.train.builders import (
    Quality,
    heldout_meta_tasks,
    mean_quality,
    meta_model,
    server_device,
    tto_qualities,
    tto_schedule,
)
from fedfields.train.checkpoint import META_CHECKPOINT_FORMAT
from fedfields.train.federated import federated_state
from simulations.job import RoundJob, StrategyReport, reply_counts, run_strategy_job
from simulations.meta_observer import meta_observers, present
from simulations.observers import Observer
from strategies import make_strategy, strategy_class


class MetaReport(StrategyReport):
    """The meta job's report (`StrategyReport`): a line holds the clients'
    aggregated train metrics, theta's TTO quality on the public held-out tasks (if any), what
    the observers measured and PSNR - PSNR_p; at the end theta's checkpoint and tto.png.
    """

    def __init__(
        self,
        config: FederatedConfig,
        settings: MetaSettings,
        run_dir: Path,
        strategy: ProtocolStrategy,
        observers: Sequence[Observer],
    ) -> None:
        super().__init__(config, run_dir, strategy, observers)
        self.settings = settings
        self.model = meta_model(config, settings).to(server_device(config))
        self.heldout = heldout_meta_tasks(config, settings)
        if not self.heldout:
            log(
                INFO,
                "fedfields: no public held-out objects (run-config 'eval-scene-dir' is empty): "
                "the server skips test-time optimisation",
            )
        self.steps = tto_schedule(settings.tto_steps)
        self.initial: dict[int, Quality] = {}

    def score_initial(self, arrays: ArrayRecord) -> None:
        """The random initialisation's TTO curve, for tto.png."""
        self.initial = self.tto_curve(arrays_to_state(arrays)) if self.heldout else {}

    def score_round(self, outcome: RoundOutcome, arrays: ArrayRecord) -> dict[str, Any]:
        """theta's quality after TTO, with the TTO curve."""
        curve = self.tto_curve(arrays_to_state(arrays)) if self.heldout else {}
        metrics: dict[str, Any] = present(curve.get(self.steps[-1], {}))
        if curve:
            metrics["tto"] = {str(step): quality["psnr"] for step, quality in curve.items()}
        return metrics

    def derived(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """delta = PSNR - PSNR_p, where the privacy audit measured PSNR_p."""
        if "psnr" in metrics and "psnr_p" in metrics:
            return {"delta": metrics["psnr"] - metrics["psnr_p"]}
        return {}

    def headline(self, metrics: dict[str, Any]) -> str:
        """The round's main figures for the log."""
        return _headline(metrics, self.steps[-1])

    def resuming(self, initial: dict[str, Tensor]) -> None:
        """Round 0's TTO curve, for tto.png (before the RNGs are restored)."""
        if self.heldout:
            self.initial = self.tto_curve(initial)

    def tto_curve(self, state: dict[str, Tensor]) -> dict[int, Quality]:
        """Mean held-out quality after each scheduled number of TTO steps from `state`."""
        curves = [
            tto_qualities(self.model, state, task, self.config, self.settings)
            for task in self.heldout
        ]
        return {step: mean_quality([curve[step] for curve in curves]) for step in self.steps}

    def summary_entries(self) -> dict[str, Any]:
        """The task, strategy, meta-learner, settings and round 0's TTO curve."""
        return {
            "task": self.config.common.task,
            "strategy": self.config.strategy_name,
            "meta-learner": self.config.meta.meta_learner,
            "settings": asdict(self.settings),
            "initial": {str(step): quality for step, quality in self.initial.items()},
        }

    def final_scores(self, arrays: ArrayRecord) -> dict[str, Any]:
        """theta's checkpoint and tto.png; the last round's line as the final figures."""
        payload = {
            "format": META_CHECKPOINT_FORMAT,
            "model": {"kind": type(self.model).__name__, **asdict(self.model.config)},
            "state_dict": arrays_to_state(arrays),
            "settings": asdict(self.settings),
            "run-config": self.config.to_run_config(),
        }
        atomic.save_torch(self.run_dir / "checkpoint.pt", payload)
        if self.initial:
            _plot_tto(self.run_dir / "tto.png", self.steps, self.initial, self.history)
        return dict(self.history[-1]) if self.history else {}


def _plot_tto(
    path: Path,
    steps: Sequence[int],
    initial: dict[int, Quality],
    history: Sequence[dict[str, Any]],
) -> None:
    """Held-out PSNR against TTO steps: from the random initialisation and after each round."""
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    if initial:
        label = "round 0 (random init)"
        axes.plot(steps, [initial[s]["psnr"] for s in steps], "k--", marker="o", label=label)
    colours = [str(0.8 - 0.6 * i / max(1, len(history) - 1)) for i in range(len(history))]
    for line, colour in zip(history, colours, strict=True):
        last = line is history[-1]
        axes.plot(
            steps,
            [line["tto"][str(s)] for s in steps],
            color="tab:blue" if last else colour,
            marker="o" if last else None,
            label=f"round {line['round']}" if last else None,
        )
    axes.set_xscale("symlog", linthresh=1)
    axes.set(xlabel="TTO steps", ylabel="held-out PSNR (dB)", title="TTO (grey: earlier rounds)")
    axes.legend()
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=120)


def _headline(metrics: dict[str, Any], tto_steps: int) -> str:
    """The round's main figures for the log."""
    shown = [f"{key} {metrics[key]:.4g}" for key in (TRAIN_LOSS, GAMMA) if key in metrics]
    if "psnr" in metrics:
        shown.append(f"PSNR after {tto_steps} TTO steps {metrics['psnr']:.2f} dB")
    if "psnr_p" in metrics:
        shown.append(f"PSNR_p {metrics['psnr_p']:.2f} dB")
    shown.append(f"{reply_counts(metrics)} ({metrics['seconds']:.0f} s)")
    return ", ".join(shown)


def make_meta_strategy(config: FederatedConfig, settings: MetaSettings) -> ProtocolStrategy:
    """The run-config's strategy sampling M of the N clients per round; no federated eval.

    M is clients-per-round raised to min-train-nodes. The first round waits up to
    `round-timeout` for min-available-nodes (0: the N nodes), then goes on with those
    connected (at least M). FedMeNF takes M and N itself; the others take their sampling.
    """
    clients, wanted = meta_round_sizes(config, settings)
    common: StrategyOptions = {
        "fraction_evaluate": 0.0,
        "secure_aggregation": config.secure.secure_aggregation_config(),
        "node_timeout": config.deployment.round_timeout,
        "sampling_seed": config.common.seed,
        "differential_privacy": config.dp.dp_config(),
        "compression": config.compression.compression_config(),
    }
    if issubclass(strategy_class(config.strategy_name), FedMeNF):
        meta_sampling = {"clients_per_round": clients, "num_clients": settings.num_clients}
        return make_strategy(config, min_available_nodes=wanted, **common, **meta_sampling)
    sampling = m_of_n_sampling(clients, settings.num_clients, wanted)
    return make_strategy(config, **common, **sampling)


def run_meta_job(
    grid: Grid, config: FederatedConfig, observers: list[Observer] | None = None
) -> Path:
    """Run the FedMeNF job on `grid` (`simulations.job.run_strategy_job`); returns the run dir.

    `observers` None attaches `meta_observers(config)`: none unless a simulation launcher set
    run-config `simulation-audit`; [] runs without any.
    """
    settings = meta_settings(config)

    def attached(run_dir: Path) -> list[Observer]:
        return meta_observers(config, run_dir) if observers is None else observers

    def report(run_dir: Path, audits: list[Observer], initial: dict[str, Tensor]) -> MetaReport:
        return MetaReport(config, settings, run_dir, job.strategy, audits)

    job = RoundJob(
        strategy=make_meta_strategy(config, settings),  # an unknown one fails before any write
        train_config=ConfigRecord({LOCAL_STEPS: settings.outer_steps}),
        initial_state=lambda: federated_state(meta_model(config, settings)),
        observers=attached,
        report=report,
    )
    return run_strategy_job(grid, config, job)
