"""The FedMeNF job a ServerApp runs for task faces, video or objects: strategy, rounds, report.

Each round the server scores the global meta-learner theta by test-time optimisation (TTO) on
held-out tasks no client holds: PSNR/SSIM (LPIPS where available) of the query set after 0,
1, 2, 4, ... `tto-steps` steps on the support set. With `privacy-audit` (simulation only,
where the server can read the clients' data) it also computes PSNR_p (FedMeNF Eq. 6): each
participating client's uploaded local meta-learner w rendered at that client's own query
coordinates against its private query images. The audit reads the uploads through
`UploadRecorder`, a Grid wrapper that keeps copies of the train replies (each names its
client in the CLIENT record), and loads the clients' data itself; the strategy sees neither.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from matplotlib.figure import Figure
from torch import Tensor, nn

from clients.meta_client import CLIENT, CLIENT_INDEX
from fedfields.flower_io import ARRAYS, LOCAL_STEPS, arrays_to_state, state_to_arrays
from fedfields.train.federated import federated_state
from fedfields.train.meta import privacy_metrics, test_time_optimise
from fedfields.train.meta_tasks import MetaTask
from fedfields.train.run_config import (
    FederatedConfig,
    MetaSettings,
    client_meta_tasks,
    heldout_meta_tasks,
    meta_model,
    meta_settings,
)
from simulations.federated_nerf import make_run_dir, secure_aggregation_report
from strategies import FedAvg, FedMeNF, FedProx, Scaffold, m_of_n_sampling

RENDERED_CLIENTS = 4  # rows of the render grid: the last round's first participants
Quality = dict[str, float | None]


@dataclass
class Upload:
    """One client's uploaded local meta-learner w, as the audit captured it from the reply."""

    client: int
    state: dict[str, Tensor]


class UploadRecorder(Grid):
    """A Grid that forwards everything to `grid` and keeps the successful train replies' uploads.

    Simulation-only plumbing for the privacy audit: the strategy gets the replies unchanged.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.uploads: list[Upload] = []

    def take(self) -> list[Upload]:
        """The uploads recorded since the last call, in client order."""
        uploads, self.uploads = sorted(self.uploads, key=lambda u: u.client), []
        return uploads

    def set_run(self, run: Run) -> None:
        """Set the run of the wrapped grid."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A message built by the wrapped grid."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped grid's node ids."""
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push through the wrapped grid."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull through the wrapped grid, recording train uploads."""
        return self._record(self.grid.pull_messages(message_ids))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send and receive through the wrapped grid, recording train uploads."""
        return self._record(self.grid.send_and_receive(messages, timeout=timeout))

    def _record(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        for reply in replies:
            if reply.metadata.message_type != MessageType.TRAIN or reply.has_error():
                continue
            if CLIENT in reply.content and ARRAYS in reply.content:
                client = int(reply.content[CLIENT][CLIENT_INDEX])
                self.uploads.append(Upload(client, arrays_to_state(reply.content[ARRAYS])))
        return replies


def tto_schedule(max_steps: int) -> tuple[int, ...]:
    """TTO step counts scored: 0, 1, 2, 4, ... below `max_steps`, then `max_steps`."""
    steps, power = [0], 1
    while power < max_steps:
        steps.append(power)
        power *= 2
    return (*steps, max_steps) if max_steps > 0 else (0,)


class CapturedRender:
    """A task whose last `render_query` is kept: `test_time_optimise` scores, not returns, it."""

    def __init__(self, task: MetaTask) -> None:
        self.task = task
        self.last: Tensor | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def render_query(self, model: nn.Module, params: dict[str, Tensor]) -> Tensor:
        """The wrapped task's render, remembered."""
        self.last = self.task.render_query(model, params)
        return self.last


class MetaAudit:
    """Flower's evaluate_fn for the meta job: TTO on held-out tasks, PSNR_p of the uploads."""

    def __init__(
        self,
        config: FederatedConfig,
        settings: MetaSettings,
        run_dir: Path,
        recorder: UploadRecorder | None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.run_dir = run_dir
        self.recorder = recorder
        self.model = meta_model(config, settings)
        self.heldout = heldout_meta_tasks(config, settings)
        self.steps = tto_schedule(settings.tto_steps)
        self.started = time.perf_counter()
        self.initial: dict[int, Quality] = {}
        self.history: list[dict[str, Any]] = []
        self.last_uploads: list[Upload] = []

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Score theta of `server_round`; from round 1 append a line to metrics.jsonl."""
        curve = self.tto_curve(arrays_to_state(arrays))
        final = curve[self.steps[-1]]
        if server_round == 0:
            self.initial = curve
            return _metric_record(final)
        metrics: dict[str, Any] = {"round": server_round, **_present(final)}
        uploads = self.recorder.take() if self.recorder is not None else []
        if uploads:
            self.last_uploads = uploads
            privacy = _mean([self.privacy(upload) for upload in uploads])
            metrics |= _present(privacy)
            metrics["delta"] = final["psnr"] - privacy["psnr_p"]
            metrics["clients"] = [upload.client for upload in uploads]
        metrics["seconds"] = time.perf_counter() - self.started
        metrics["tto"] = {str(step): quality["psnr"] for step, quality in curve.items()}
        self.history.append(metrics)
        with (self.run_dir / "metrics.jsonl").open("a") as out:
            out.write(json.dumps(metrics) + "\n")
        log(
            INFO,
            "fedfields round %d: PSNR after %d TTO steps %.2f dB, PSNR_p %s (%.0f s)",
            server_round,
            self.steps[-1],
            final["psnr"],
            f"{metrics['psnr_p']:.2f} dB" if "psnr_p" in metrics else "not audited",
            metrics["seconds"],
        )
        return _metric_record(metrics)

    def tto_curve(self, state: dict[str, Tensor]) -> dict[int, Quality]:
        """Mean held-out quality after each scheduled number of TTO steps from `state`."""
        curves = [self.test_time_optimise(state, task) for task in self.heldout]
        return {step: _mean([curve[step] for curve in curves]) for step in self.steps}

    def test_time_optimise(self, state: dict[str, Tensor], task: MetaTask) -> dict[int, Quality]:
        """`fedfields.train.meta.test_time_optimise` with the task's preset schedule."""
        return test_time_optimise(
            self.model,
            state,
            task,
            self.steps,
            learning_rate=self.settings.tto_lr,
            batch_size=self.settings.support_batch,
            seed=self.config.seed,
        )

    def privacy(self, upload: Upload) -> Quality:
        """PSNR_p, SSIM_p, LPIPS_p of one upload, averaged over its client's tasks."""
        tasks = client_meta_tasks(self.config, self.settings, upload.client)
        return _mean([privacy_metrics(self.model, upload.state, task) for task in tasks])

    def finish(self, arrays: ArrayRecord) -> dict[str, Any]:
        """Checkpoint of theta, TTO and privacy plots, the render grid and summary.json."""
        state = arrays_to_state(arrays)
        payload = {
            "format": "fedfields-meta-checkpoint-1",
            "model": {"kind": type(self.model).__name__, **asdict(self.model.config)},
            "state_dict": state,
            "settings": asdict(self.settings),
            "run-config": self.config.to_run_config(),
        }
        partial = self.run_dir / "checkpoint.pt.partial"
        torch.save(payload, partial)
        partial.replace(self.run_dir / "checkpoint.pt")
        _plot_tto(self.run_dir / "tto.png", self.steps, self.initial, self.history)
        _plot_privacy(self.run_dir / "privacy.png", self.history)
        if self.last_uploads:
            self.render_grid(state, self.last_uploads[:RENDERED_CLIENTS])
        summary = {
            "secure-aggregation": secure_aggregation_report(self.config),
            "task": self.config.task,
            "strategy": self.config.strategy_name,
            "meta-learner": self.config.meta_learner,
            "settings": asdict(self.settings),
            "initial": {str(step): quality for step, quality in self.initial.items()},
            "final": self.history[-1] if self.history else {},
            "rounds": self.history,
            "seconds": time.perf_counter() - self.started,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def render_grid(self, state: dict[str, Tensor], uploads: Sequence[Upload]) -> None:
        """Per client: private query image | render of its upload | TTO result from theta."""
        figure = Figure(figsize=(7.5, 2.5 * len(uploads)))
        axes = figure.subplots(len(uploads), 3, squeeze=False)
        for row, upload in zip(axes, uploads, strict=True):
            private = client_meta_tasks(self.config, self.settings, upload.client)[0]
            leaked = privacy_metrics(self.model, upload.state, private, with_lpips=False)
            task = CapturedRender(private)
            tto_psnr = self.test_time_optimise(state, task)[self.steps[-1]]["psnr"]
            leak = private.render_query(self.model, upload.state)
            images = (private.query_targets, leak, task.last)
            titles = (
                f"client {upload.client}: private query",
                f"server, from its upload\nPSNR_p {leaked['psnr_p']:.1f} dB",
                f"TTO {self.steps[-1]} steps from theta\nPSNR {tto_psnr:.1f} dB",
            )
            for axis, values, title in zip(row, images, titles, strict=True):
                axis.imshow(_first_image(private, values), cmap="gray", vmin=0.0, vmax=1.0)
                axis.set_title(title, fontsize=8)
                axis.set_axis_off()
        figure.tight_layout()
        figure.savefig(self.run_dir / "renders.png", dpi=120)


def _first_image(task: MetaTask, values: Tensor) -> np.ndarray:
    """The first image (frame or view) of query-shaped values, [H, W] or [H, W, 3] in [0, 1]."""
    images = task.query_images(values.clamp(0.0, 1.0))
    image = images[0] if images.ndim == 4 else images
    return image[..., 0].numpy() if image.shape[-1] == 1 else image.numpy()


def _mean(qualities: Sequence[Quality]) -> Quality:
    """Key-wise mean; a key that some entry lacks a value for (None) stays None."""
    means: Quality = {}
    for key in qualities[0]:
        values = [quality[key] for quality in qualities]
        means[key] = None if any(v is None for v in values) else float(np.mean(values))
    return means


def _present(quality: Quality) -> dict[str, float]:
    """The entries with a value (LPIPS is None without the optional package)."""
    return {key: value for key, value in quality.items() if value is not None}


def _metric_record(metrics: dict[str, Any]) -> MetricRecord:
    """The scalar entries as floats (Flower's MetricRecord takes no None, strings or dicts)."""
    return MetricRecord(
        {key: float(value) for key, value in metrics.items() if isinstance(value, int | float)}
    )


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
    figure.savefig(path, dpi=120)


def _plot_privacy(path: Path, history: Sequence[dict[str, Any]]) -> None:
    """PSNR after TTO on held-out tasks and PSNR_p of the uploads, per round."""
    if not history:
        return
    rounds = [line["round"] for line in history]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    axes.plot(rounds, [line["psnr"] for line in history], marker="o", label="PSNR after TTO")
    if all("psnr_p" in line for line in history):
        axes.plot(rounds, [line["psnr_p"] for line in history], marker="s", label="PSNR_p")
    axes.set(xlabel="round", ylabel="PSNR (dB)", title="reconstruction and privacy leakage")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def make_meta_strategy(
    config: FederatedConfig, settings: MetaSettings
) -> FedAvg | FedMeNF | Scaffold:
    """The run-config's strategy sampling M of the N clients per round; no federated eval."""
    name = config.strategy_name
    common = {"fraction_evaluate": 0.0, "secure_aggregation": config.secure_aggregation_config()}
    if name == "fedmenf":
        return FedMeNF(
            clients_per_round=config.clients_per_round,
            num_clients=settings.num_clients,
            **common,
        )
    sampling = m_of_n_sampling(config.clients_per_round, settings.num_clients)
    if name == "fedprox":
        return FedProx(proximal_mu=config.proximal_mu, **common, **sampling)
    if name == "scaffold":
        return Scaffold(global_lr=config.scaffold_global_lr, **common, **sampling)
    return FedAvg(**common, **sampling)


def run_meta_job(grid: Grid, run_config: dict[str, Any]) -> Path:
    """Run the FedMeNF job on `grid`; returns the run directory holding the report."""
    config = FederatedConfig.from_run_config(run_config)
    settings = meta_settings(config)
    run_dir = make_run_dir(config)
    (run_dir / "config.json").write_text(json.dumps(config.to_run_config(), indent=2))
    random.seed(config.seed)  # Flower samples each round's nodes with `random`
    torch.manual_seed(config.seed)
    initial = federated_state(meta_model(config, settings))
    audited = config.privacy_audit and not config.secure_aggregation  # uploads are masked
    recorder = UploadRecorder(grid) if audited else None
    audit = MetaAudit(config, settings, run_dir, recorder)
    result = make_meta_strategy(config, settings).start(
        recorder or grid,
        state_to_arrays(initial),
        num_rounds=config.num_server_rounds,
        train_config=ConfigRecord({LOCAL_STEPS: settings.outer_steps}),
        evaluate_fn=audit,
    )
    summary = audit.finish(result.arrays)
    log(INFO, "fedfields: secure aggregation %s", json.dumps(summary["secure-aggregation"]))
    log(INFO, "fedfields: final %s", json.dumps(summary["final"]))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir
