"""The federated NeRF job a ServerApp runs: strategy, rounds, server-side audit, run directory.

The server's global field is scored every round on clean views (what the scene looks like
without anyone's personal content) and inside the personal-content masks (how much of the
users' persons the server's field reproduces: lower is less leakage). That audit reads the
crowd's ground truth, so it exists only where the server can see the data: in simulation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from matplotlib.figure import Figure
from PIL import Image

from fedfields.aggregate import round_cost
from fedfields.data import Scene, load_scene
from fedfields.data.crowd import CrowdUser, load_crowd_user
from fedfields.flower_io import arrays_to_state, state_to_arrays
from fedfields.metrics import psnr, ssim
from fedfields.render import OccupancyGrid, render_image
from fedfields.train import save_checkpoint
from fedfields.train.federated import federated_state, load_federated_state
from fedfields.train.run_config import (
    FederatedConfig,
    global_field,
    render_config,
)
from strategies import DecentNeRF, FedAvg, FedProx, Scaffold

OCCUPANCY_PASSES = 2  # grid refreshes from a freshly aggregated field before rendering


@dataclass
class CrowdData:
    """Every user's views with their masks and clean images, and the held-out clean views."""

    users: list[CrowdUser]
    heldout: Scene | None

    @classmethod
    def load(cls, data_dir: str, downscale: float) -> CrowdData:
        """Read a `fedfields data crowd` folder; a clear error if it is not one."""
        root = Path(data_dir)
        folders = sorted(root.glob("user_*"))
        if not folders:
            raise FileNotFoundError(
                f"{root}: no user_NN folders; build one with `fedfields data crowd`"
            )
        users = [load_crowd_user(folder, downscale=downscale) for folder in folders]
        heldout = None
        if (root / "heldout" / "transforms.json").is_file():
            heldout = load_scene(root / "heldout", downscale=downscale)
        return cls(users, heldout)


def score_crowd(
    render: Callable[[Scene, int], torch.Tensor],
    users: list[CrowdUser],
    views: list[int] | None = None,
) -> dict[str, float]:
    """Clean-view PSNR/SSIM and PSNR inside the personal masks (leakage) over users' views.

    `render(scene, view)` gives an [H, W, 3] image; `views` None scores every view.
    """
    clean, personal, predictions, targets = [], [], [], []
    for user in users:
        for view in views if views is not None else range(len(user.scene)):
            image = render(user.scene, view)
            clean.append(psnr(image, user.clean_images[view]))
            personal.append(psnr(image, user.scene.images[view], user.personal_masks[view]))
            predictions.append(image)
            targets.append(user.clean_images[view])
    return {
        "clean-psnr": float(np.mean(clean)),
        "clean-ssim": ssim(torch.stack(predictions), torch.stack(targets)),
        "personal-psnr": float(np.mean(personal)),
    }


class ServerAudit:
    """Scores the server's global field each round and writes the run directory's report."""

    def __init__(
        self, config: FederatedConfig, data: CrowdData, run_dir: Path, num_parameters: int
    ) -> None:
        self.config = config
        self.data = data
        self.run_dir = run_dir
        self.scene = data.users[0].scene
        self.field = global_field(config, self.scene)
        self.render_config = render_config(self.scene)
        self.occupancy = OccupancyGrid(self.scene.aabb)
        self.num_parameters = num_parameters
        self.started = time.perf_counter()
        self.history: list[dict[str, Any]] = []

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Flower's evaluate_fn: score a spread of user views (and held-out views) this round.

        Round 0 (the random initial field) is not rendered: it says nothing and is slow.
        """
        if server_round == 0:
            return MetricRecord({"round": 0.0})
        self._load(arrays)
        every = max(1, len(self.data.users) // max(1, self.config.eval_views_per_round))
        users = self.data.users[::every][: self.config.eval_views_per_round]
        metrics = self._score_users(users, views=[0])
        if self.data.heldout is not None:
            count = min(len(self.data.heldout), self.config.eval_views_per_round)
            metrics["heldout-psnr"] = self._score_scene(self.data.heldout, range(count))[0]
        cost = round_cost(self.config.strategy_name, self.num_parameters, self._clients_per_round())
        metrics |= {
            "round": server_round,
            "seconds": time.perf_counter() - self.started,
            "server-flops": float(cost.server_flops),
            "uplink-bytes": float(cost.uplink_bytes),
            "downlink-bytes": float(cost.downlink_bytes),
        }
        self.history.append(metrics)
        with (self.run_dir / "metrics.jsonl").open("a") as out:
            out.write(json.dumps(metrics) + "\n")
        log(
            INFO,
            "fedfields round %d: clean PSNR %.2f dB, personal-mask PSNR %.2f dB (%.0f s)",
            server_round,
            metrics["clean-psnr"],
            metrics["personal-psnr"],
            metrics["seconds"],
        )
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    def _clients_per_round(self) -> int:
        users = len(self.data.users)
        return max(int(users * self.config.fraction_train), min(self.config.min_train_nodes, users))

    def _load(self, arrays: ArrayRecord) -> None:
        load_federated_state(self.field, arrays_to_state(arrays))
        self.field.eval()
        self.occupancy = OccupancyGrid(self.scene.aabb)
        for _ in range(OCCUPANCY_PASSES):
            self.occupancy.update(self.field.density, self.render_config.step_size)

    def _render(self, scene: Scene, view: int) -> torch.Tensor:
        rendered = render_image(self.field, scene.cameras, view, self.render_config, self.occupancy)
        return rendered.rgb.clamp(0.0, 1.0)

    def _score_scene(self, scene: Scene, views: range) -> tuple[float, float, list[torch.Tensor]]:
        """Mean PSNR and SSIM of the server's renders against `scene`'s images."""
        renders = [self._render(scene, view) for view in views]
        targets = scene.images[list(views)]
        values = [psnr(r, t) for r, t in zip(renders, targets, strict=True)]
        return float(np.mean(values)), ssim(torch.stack(renders), targets), renders

    def _score_users(self, users: list[CrowdUser], views: list[int] | None) -> dict[str, float]:
        return score_crowd(self._render, users, views)

    def finish(self, arrays: ArrayRecord) -> dict[str, Any]:
        """Full evaluation of the final field, checkpoint, renders and plots."""
        self._load(arrays)
        final = self._score_users(self.data.users, views=None)
        if self.data.heldout is not None:
            heldout_psnr, heldout_ssim, _ = self._score_scene(
                self.data.heldout, range(len(self.data.heldout))
            )
            final |= {"heldout-psnr": heldout_psnr, "heldout-ssim": heldout_ssim}
        metadata = {"strategy": self.config.strategy_name, "data-dir": self.config.data_dir}
        save_checkpoint(
            self.run_dir / "checkpoint.pt", self.field, self.render_config, self.occupancy, metadata
        )
        self._write_renders()
        _plot_alphas(self.run_dir)
        _plot_leakage(self.run_dir, self.history)
        summary = {
            "secure-aggregation": secure_aggregation_report(self.config),
            "final": final,
            "rounds": self.history,
            "seconds": time.perf_counter() - self.started,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _write_renders(self) -> None:
        """Per user: clean ground truth | server render | the user's photo, masks outlined."""
        out = self.run_dir / "renders"
        out.mkdir(exist_ok=True)
        for index, user in enumerate(self.data.users):
            render = self._render(user.scene, 0)
            photo = user.scene.images[0].clone()
            photo[_outline(user.personal_masks[0])] = torch.tensor([1.0, 0.0, 1.0])
            strip = torch.cat([user.clean_images[0], render, photo], dim=1).numpy()
            Image.fromarray((strip * 255 + 0.5).astype(np.uint8)).save(
                out / f"user_{index:02d}.png"
            )


def _outline(mask: torch.Tensor) -> torch.Tensor:
    """Mask pixels with a neighbour outside the mask."""
    padded = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), mode="replicate")
    eroded = -torch.nn.functional.max_pool2d(-padded, 3, stride=1)[0, 0]
    return mask & (eroded < 0.5)


def _plot_alphas(run_dir: Path) -> None:
    """alpha_k over rounds, from what clients logged in simulation (DecentNeRF only)."""
    path = run_dir / "alphas.jsonl"
    if not path.is_file():
        return
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for user in sorted({r["user"] for r in records}):
        points = sorted((r["round"], r["alpha"]) for r in records if r["user"] == user)
        axes.plot(*zip(*points, strict=True), marker="o", label=f"user {user}")
    axes.set(xlabel="round", ylabel="alpha", title="DecentNeRF learned federation weights")
    axes.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(run_dir / "alphas.png", dpi=120)


def _plot_leakage(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """Clean-view PSNR and personal-mask PSNR (leakage) of the server's field per round."""
    if not history:
        return
    rounds = [h["round"] for h in history]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    axes.plot(rounds, [h["clean-psnr"] for h in history], marker="o", label="clean views")
    axes.plot(rounds, [h["personal-psnr"] for h in history], marker="s", label="personal masks")
    axes.set(xlabel="round", ylabel="PSNR (dB)", title="server global field")
    axes.legend()
    figure.tight_layout()
    figure.savefig(run_dir / "leakage.png", dpi=120)


def secure_aggregation_report(config: FederatedConfig) -> dict[str, Any]:
    """What the report says about secure aggregation: on or off, and its SecAgg+ settings."""
    secure = config.secure_aggregation_config()
    if secure is None:
        return {"enabled": False}
    return {"enabled": True, "protocol": "Flower SecAgg+", **asdict(secure)}


def make_strategy(config: FederatedConfig, num_users: int) -> FedAvg | Scaffold | DecentNeRF:
    """The strategy named by run-config, sampling `fraction-train` of the users per round."""
    sampling = {
        "fraction_train": config.fraction_train,
        "min_train_nodes": min(config.min_train_nodes, num_users),
        "min_available_nodes": num_users,
        "fraction_evaluate": 0.0,
        "secure_aggregation": config.secure_aggregation_config(),
    }
    if config.strategy_name == "fedavg":
        return FedAvg(**sampling)
    if config.strategy_name == "fedprox":
        return FedProx(proximal_mu=config.proximal_mu, **sampling)
    if config.strategy_name == "scaffold":
        return Scaffold(global_lr=config.scaffold_global_lr, **sampling)
    return DecentNeRF(alpha_lr=config.alpha_lr, **sampling)


def make_run_dir(config: FederatedConfig) -> Path:
    """The run directory: run-config's `run-dir`, else runs/<UTC time>-<strategy>."""
    if config.run_dir:
        path = Path(config.run_dir)
    else:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        path = Path.cwd() / "runs" / f"{stamp}-{config.strategy_name}"
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise FileExistsError(f"run directory {path} is not empty; pick a new run-dir")
    return path


def run_federated_nerf(grid: Grid, run_config: dict[str, Any]) -> Path:
    """Run the whole job on `grid`; returns the run directory holding the report."""
    config = FederatedConfig.from_run_config(run_config)
    data = CrowdData.load(config.data_dir, config.downscale)
    run_dir = make_run_dir(config)
    (run_dir / "config.json").write_text(json.dumps(config.to_run_config(), indent=2))
    torch.manual_seed(config.seed)
    initial = federated_state(global_field(config, data.users[0].scene))
    audit = ServerAudit(config, data, run_dir, sum(t.numel() for t in initial.values()))
    strategy = make_strategy(config, len(data.users))
    train_config = ConfigRecord(
        {"local-steps": config.local_steps, "run-dir": str(run_dir.resolve())}
    )
    result = strategy.start(
        grid,
        state_to_arrays(initial),
        num_rounds=config.num_server_rounds,
        train_config=train_config,
        evaluate_fn=audit,
    )
    summary = audit.finish(result.arrays)
    log(INFO, "fedfields: secure aggregation %s", json.dumps(summary["secure-aggregation"]))
    log(INFO, "fedfields: final %s", json.dumps(summary["final"]))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir
