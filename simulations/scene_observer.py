"""The scene job's simulation-only observer: what the server's field shows of every user's views.

It reads the crowd's ground truth as the experimenter (run-config `data-dir`): each round it
scores the global field on clean views (the scene without anyone's personal content) and
inside the personal-content masks (how much of the users' persons the field reproduces: lower
is less leakage), and, where replies carry a user's global field in plaintext (FedAvg-family
uploads, or DecentNeRF's alpha_k g_k without secure aggregation), that upload on its user's
view: what the server can read of each user (DecentNeRF paper, Fig. 7a); at the end it
scores every view, writes leakage.png, renders/ (each user's photo beside the server's
render) and the learned alphas the virtual nodes keep in their state directories
(alphas.jsonl, alphas.png).
A deployed server has none of this data and runs without it.

Per-user output (renders/ with the users' photos, alphas_k) is the experimenter's, read from
the nodes' state and data, never the server's: with secure aggregation on, where the server
must hold nothing per client, it goes to `<run-dir>.audit/` beside the run directory
(`audit_dir`), and the run directory keeps only what the server could compute from sums.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from matplotlib.figure import Figure
from PIL import Image

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data.crowd import CrowdData
from fedfields.flower.protocol import arrays_to_state
from fedfields.methods import ALPHA_KEY
from fedfields.methods.decentnerf import ALPHA_STATE
from fedfields.metrics import psnr
from fedfields.privacy.leakage import PERSONAL_FLOOR, UPLOAD_LEAK, score_crowd
from fedfields.train.evaluation import FieldRenderer
from simulations.observers import ReplyTap, plaintext_uploads, train_replies


class GlobalRenderer:
    """The global field's one `FieldRenderer` in a scene job, shared by the report and the
    observers: loaded (its occupancy grid rebuilt) once per round and once at the end."""

    def __init__(self, config: FederatedConfig) -> None:
        self.renderer = FieldRenderer(config)
        self.loaded: int | str | None = None

    def at(self, moment: int | str, arrays: ArrayRecord) -> FieldRenderer:
        """The renderer holding `arrays`, the global field at `moment` (a round, or "final")."""
        if moment != self.loaded:
            self.renderer.load(arrays_to_state(arrays))
            self.loaded = moment
        return self.renderer


def audit_dir(run_dir: Path) -> Path:
    """Where a secure run's per-user audit output goes: `<run-dir>.audit/`, outside it."""
    return run_dir.with_name(run_dir.name + ".audit")


class CrowdObserver:
    """Simulation-only audit of the scene job against the crowd's ground truth.

    `per_user_dir` receives what is per user (renders/, alphas): the run directory, or
    `audit_dir(run_dir)` with secure aggregation on (module docstring).
    """

    def __init__(
        self, config: FederatedConfig, data: CrowdData, run_dir: Path, global_field: GlobalRenderer
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.per_user_dir = audit_dir(run_dir) if config.secure.secure_aggregation else run_dir
        self.data = data
        self.global_field = global_field
        self.uploads_renderer = FieldRenderer(config)
        """Renders each user's readable upload (a field of its own, loaded once each)."""
        self.replies: list[Message] = []

    def wrap_grid(self, grid: Grid) -> Grid:
        """A `ReplyTap` keeping each plaintext upload of a user's global field."""
        return ReplyTap(grid, self.record)

    def record(self, replies: list[Message]) -> None:
        """Keep the successful train replies until the round's gate has judged them."""
        self.replies += train_replies(replies)

    def uploads(self, accepted: Collection[int]) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """(user, g_k) of the accepted replies whose arrays the server can read."""
        uploads = []
        for user, arrays in plaintext_uploads(self.replies, accepted, len(self.data.users)):
            state = arrays_to_state(arrays)
            alpha = state.pop(ALPHA_KEY, None)
            if alpha is not None:  # DecentNeRF in plaintext: alpha_k g_k and alpha_k
                state = {key: value / float(alpha.reshape(())) for key, value in state.items()}
            uploads.append((user, state))
        return uploads

    def observe_round(
        self, server_round: int, arrays: ArrayRecord, accepted: Collection[int] = ()
    ) -> dict[str, Any]:
        """Score a spread of users' first views (and held-out views) of this round's field,
        and each readable upload of an `accepted` node inside its user's masks."""
        metrics: dict[str, Any] = {}
        uploads, self.replies = self.uploads(accepted), []
        if uploads:
            leaks = []
            for user, state in uploads:
                self.uploads_renderer.load(state)
                image = self.uploads_renderer(self.data.users[user].scene, 0)
                crowd_user = self.data.users[user]
                leaks.append(psnr(image, crowd_user.scene.images[0], crowd_user.personal_masks[0]))
            metrics[UPLOAD_LEAK] = float(np.mean(leaks))
        renderer = self.global_field.at(server_round, arrays)
        count = self.config.scene.eval_views_per_round
        every = max(1, len(self.data.users) // max(1, count))
        metrics |= score_crowd(renderer, self.data.users[::every][:count], views=[0])
        if self.data.heldout is not None:
            views = range(min(len(self.data.heldout), count))
            metrics["heldout-psnr"] = renderer.score_scene(self.data.heldout, views)["psnr"]
        return metrics

    def finish(self, arrays: ArrayRecord, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Every view scored, renders, alphas (in `per_user_dir`) and leakage plots; the
        final scores."""
        renderer = self.global_field.at("final", arrays)
        final = score_crowd(renderer, self.data.users, views=None, perceptual=True)
        if self.data.heldout is not None:
            heldout = self.data.heldout
            scores = renderer.score_scene(heldout, range(len(heldout)), perceptual=True)
            final |= {f"heldout-{name}": value for name, value in scores.items()}
        self.per_user_dir.mkdir(parents=True, exist_ok=True)
        self._write_renders(renderer)
        alphas = node_alphas(self.config.deployment.state_dir)
        if alphas:
            atomic.write_json_lines(self.per_user_dir / "alphas.jsonl", alphas)
            plot_alphas(self.per_user_dir / "alphas.png", alphas)
        plot_leakage(self.run_dir / "leakage.png", history)
        return {"final": final}

    def _write_renders(self, renderer: FieldRenderer) -> None:
        """Per user: clean ground truth | `renderer`'s field (the server's) | the user's photo,
        masks outlined."""
        out = self.per_user_dir / "renders"
        out.mkdir(exist_ok=True)
        for index, user in enumerate(self.data.users):
            render = renderer(user.scene, 0)
            photo = user.scene.images[0].clone()
            photo[_outline(user.personal_masks[0])] = torch.tensor([1.0, 0.0, 1.0])
            strip = torch.cat([user.clean_images[0], render, photo], dim=1).numpy()
            image = Image.fromarray((strip * 255 + 0.5).astype(np.uint8))
            atomic.save_image(out / f"user_{index:02d}.png", image)


def node_alphas(state_root: str) -> list[dict[str, Any]]:
    """alpha_k per round as the virtual nodes keep it (`<state_root>/node_NN/`, `ALPHA_STATE`)."""
    if not state_root:
        return []
    lines = []
    for path in sorted(Path(state_root).glob(f"node_*/{ALPHA_STATE}.json")):
        user = int(path.parent.name.split("_")[1])
        for server_round, alpha in json.loads(path.read_text()).get("history", []):
            lines.append({"round": server_round, "user": user, "alpha": alpha})
    return sorted(lines, key=lambda line: (line["round"], line["user"]))


def _outline(mask: torch.Tensor) -> torch.Tensor:
    """Mask pixels with a neighbour outside the mask."""
    padded = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), mode="replicate")
    eroded = -torch.nn.functional.max_pool2d(-padded, 3, stride=1)[0, 0]
    return mask & (eroded < 0.5)


def plot_alphas(path: Path, records: list[dict[str, Any]]) -> None:
    """alpha_k over rounds (DecentNeRF's learned federation weights)."""
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for user in sorted({r["user"] for r in records}):
        points = sorted((r["round"], r["alpha"]) for r in records if r["user"] == user)
        axes.plot(*zip(*points, strict=True), marker="o", label=f"user {user}")
    axes.set(xlabel="round", ylabel="alpha", title="DecentNeRF learned federation weights")
    axes.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=120)


def plot_leakage(path: Path, history: list[dict[str, Any]]) -> None:
    """Clean-view PSNR and personal-mask PSNR (leakage) of the server's field per round."""
    rows = [h for h in history if "clean-psnr" in h]
    if not rows:
        return
    rounds = [h["round"] for h in rows]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    axes.plot(rounds, [h["clean-psnr"] for h in rows], marker="o", label="clean views")
    axes.plot(rounds, [h["personal-psnr"] for h in rows], marker="s", label="personal masks")
    if all(UPLOAD_LEAK in h for h in rows):
        uploads = [h[UPLOAD_LEAK] for h in rows]
        axes.plot(rounds, uploads, marker="^", label="personal masks, users' uploads")
    if all(PERSONAL_FLOOR in h for h in rows):
        floor = [h[PERSONAL_FLOOR] for h in rows]
        axes.plot(rounds, floor, linestyle="--", color="grey", label="floor: no person rendered")
    axes.set(xlabel="round", ylabel="PSNR (dB)", title="server global field")
    axes.legend()
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=120)
