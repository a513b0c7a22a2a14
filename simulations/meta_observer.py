"""The meta job's simulation-only observer: PSNR_p of every upload and the inference attacks.

PSNR_p (FedMeNF Eq. 6) needs the clients' private query images, so it is not the server's:
`PrivacyAudit`, attached by `meta_observers` when a simulation launcher sets run-config
`simulation-audit`, sees the train replies through a `ReplyTap` (each names its client in the
CLIENT record), renders each upload w at that client's own query coordinates and compares with
its images, which it reads as the experimenter; the strategy sees neither. At the end it runs
FedMeNF App. C's membership (and, for objects, property) inference on every client's last
upload and writes privacy.png and renders.png. A deployed server has none of this data and
runs without it (the scene job's counterpart is `simulations.scene_observer`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from matplotlib.figure import Figure
from torch import Tensor, nn

from fedfields import atomic
from fedfields.config import FederatedConfig, MetaSettings, meta_settings
from fedfields.flower.protocol import arrays_to_state
from fedfields.privacy.attacks.inference import (
    AttackConfig,
    AttackResult,
    attack_folds,
    membership_pairs,
    pooled,
    shadow_membership_pairs,
    similarity_pairs,
    threshold_attack,
    train_attack,
)
from fedfields.train.builders import (
    Quality,
    as_image_batch,
    client_meta_tasks,
    client_object_folder,
    mean_quality,
    meta_model,
    server_device,
    tto_qualities,
    tto_schedule,
)
from fedfields.train.meta import privacy_metrics, rescaled_privacy_psnr
from fedfields.train.meta_tasks import MetaTask
from simulations.observers import Observer, ReplyTap, plaintext_uploads, train_replies

RENDERED_CLIENTS = 4  # rows of the render grid: the last round's first participants
MIN_ATTACK_CLIENTS = 5  # the inference attacks need shadow and target clients
ATTACK_FOLDS = 5  # every client a target once; each attacker trains on the other 4/5
MAX_ATTACK_CLIENTS = 50
"""The attacks' cost grows with the square of the clients attacked (each shadow upload renders
every shadow client's views); above this many clients with an upload, a seeded sample of this
many is attacked (summary "attack-clients" says how many)."""


@dataclass
class Upload:
    """One client's uploaded local meta-learner w, as the audit captured it from the reply."""

    client: int
    state: dict[str, Tensor]


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


class PrivacyAudit:
    """Simulation-only observer: PSNR_p, SSIM_p, LPIPS_p of every upload (FedMeNF Eq. 6),
    privacy.png and renders.png.

    It reads the participating clients' private tasks as the experimenter: faces and video
    from scikit-image by the client's index, an object from run-config `data-dir`/object_NN
    (the folder virtual node NN reads, `fedfields.flower.node`).
    """

    def __init__(self, config: FederatedConfig, settings: MetaSettings, run_dir: Path) -> None:
        self.config = config
        self.settings = settings
        self.run_dir = run_dir
        # It only renders uploaded states: building its model must not draw from the run's
        # seeded RNG, which the job seeds before it attaches its observers.
        with torch.random.fork_rng(devices=[]):
            self.model = meta_model(config, settings).to(server_device(config))
        self.steps = tto_schedule(settings.tto_steps)
        self.uploads: list[Upload] = []
        self.replies: list[Message] = []
        self.last_uploads: list[Upload] = []
        self.latest: dict[int, dict[str, Tensor]] = {}  # each client's last upload (App. C)
        self.shadow_renders: dict[tuple[int, int], tuple[list[Tensor], list[Tensor]]] = {}

    def wrap_grid(self, grid: Grid) -> Grid:
        """A `ReplyTap` keeping a copy of each successful train reply's upload."""
        return ReplyTap(grid, self.record)

    def record(self, replies: list[Message]) -> None:
        """Keep the successful train replies until the round's gate has judged them."""
        self.replies += train_replies(replies)

    def observe_round(
        self, server_round: int, arrays: ArrayRecord, accepted: Collection[int] = ()
    ) -> dict[str, Any]:
        """Mean privacy metrics of the round's uploads from `accepted` nodes and the clients
        they came from."""
        replies, self.replies = self.replies, []
        for client, upload in plaintext_uploads(replies, accepted, self.settings.num_clients):
            self.uploads.append(Upload(client, arrays_to_state(upload)))
            self.latest[client] = self.uploads[-1].state
        uploads, self.uploads = sorted(self.uploads, key=lambda u: u.client), []
        if not uploads:
            return {}
        self.last_uploads = uploads
        privacy = mean_quality([self.privacy(upload) for upload in uploads])
        return {**present(privacy), "clients": [upload.client for upload in uploads]}

    def client_tasks(self, client: int) -> list[MetaTask]:
        """Client `client`'s private tasks, read from the experimenter's data."""
        object_dir = self.object_folder(client) if self.config.common.task == "objects" else None
        return client_meta_tasks(self.config, self.settings, client, object_dir)

    def privacy(self, upload: Upload) -> Quality:
        """PSNR_p, SSIM_p, LPIPS_p of one upload and PSNR_p after rescaling its outputs
        (blind and oracle), averaged over its client's tasks."""
        tasks = self.client_tasks(upload.client)
        return mean_quality(
            [
                privacy_metrics(self.model, upload.state, task)
                | rescaled_privacy_psnr(self.model, upload.state, task)
                for task in tasks
            ]
        )

    def finish(self, arrays: ArrayRecord, history: list[dict[str, Any]]) -> dict[str, Any]:
        """privacy.png over the rounds, renders.png of the last round's uploads, and the
        inference attacks on every client's last upload (summary.json's "final")."""
        _plot_privacy(self.run_dir / "privacy.png", history)
        if self.last_uploads:
            self.render_grid(arrays_to_state(arrays), self.last_uploads[:RENDERED_CLIENTS])
        return {"final": self.inference_attacks()}

    def inference_attacks(self) -> dict[str, float]:
        """FedMeNF App. C against each client's last upload: membership inference (shadow
        clients train the attacker, the others are its targets) and, for objects, property
        inference of the object's kind. The clients are cut into up to five folds of at
        least two and each fold is the targets once, so every client's upload is attacked;
        the figures pool all folds' targets. Empty with fewer than 5 clients; a seeded sample
        of `MAX_ATTACK_CLIENTS` when more have uploaded."""
        clients = sorted(self.latest)
        if len(clients) < MIN_ATTACK_CLIENTS:
            return {}
        attacked = min(len(clients), MAX_ATTACK_CLIENTS)
        order = random.Random(self.config.common.seed).sample(clients, attacked)
        splits = attack_folds(order, min(ATTACK_FOLDS, len(order) // 2))
        kinds = None  # objects: the property the PIA infers, read once for every fold
        if self.config.common.task == "objects":
            kinds = sorted({self.object_kind(c) for c in clients})
        attacks: dict[str, list[tuple[AttackResult, int]]] = {}
        for shadow, target in splits:
            for name, scored in self.fold_attacks(shadow, target, kinds).items():
                attacks.setdefault(name, []).append(scored)
        found: dict[str, float] = {}
        for name, scored in attacks.items():
            result = pooled(*zip(*scored, strict=True))
            found[f"{name}-accuracy"], found[f"{name}-chance"] = result.accuracy, result.chance
            if result.auc is not None:
                found[f"{name}-auc"] = result.auc
        found["attack-folds"] = len(splits)
        found["attack-clients"] = attacked
        self.shadow_renders.clear()
        return found

    def fold_attacks(
        self, shadow: Sequence[int], target: Sequence[int], kinds: list[str] | None
    ) -> dict[str, tuple[AttackResult, int]]:
        """The attacks of one fold, trained on `shadow`'s uploads and scored on `target`'s,
        each with its number of target samples; property inference when `kinds` is given."""
        clamped = [self.membership_triples(group, clamp=True) for group in (shadow, target)]
        raw = [self.membership_triples(group, clamp=False) for group in (shadow, target)]
        train, test = self.shadow_pairs(shadow), membership_pairs(*clamped[1])
        attacker = AttackConfig(balance_classes=True)
        found = {"mia": (train_attack(*train, *test, attacker), len(test[1]))}
        for similarity, triples in (("mse", clamped), ("correlation", raw)):
            train, test = (similarity_pairs(*group, similarity) for group in triples)
            found[f"mia-{similarity}"] = (threshold_attack(*train, *test), len(test[1]))
        if kinds is not None:
            train, test = (self.property_samples(group, kinds) for group in (shadow, target))
            found["pia"] = (train_attack(*train, *test), len(test[1]))
        return found

    def rendered(self, client: int, task: MetaTask, clamp: bool = True) -> list[Tensor]:
        """`task`'s query images as rendered by `client`'s last upload, [H, W, C] each;
        clamped to [0, 1] as PSNR_p scores them, or the raw outputs."""
        values = task.render_query(self.model, self.latest[client])
        if clamp:
            values = values.clamp(0.0, 1.0)
        return list(as_image_batch(task.query_images(values)))

    def shadow_pairs(self, shadow: Sequence[int]) -> tuple[Tensor, Tensor]:
        """The CNN attacker's training pairs: each shadow client's query images with every
        shadow upload's clamped render of them (`shadow_membership_pairs`)."""
        images, owners = [], []
        for owner, client in enumerate(shadow):
            truth = self.shadow_views(client, client)[0]
            images += truth
            owners += [owner] * len(truth)
        renders = [
            [view for client in shadow for view in self.shadow_views(upload, client)[1]]
            for upload in shadow
        ]
        return shadow_membership_pairs(images, owners, renders)

    def shadow_views(self, upload: int, client: int) -> tuple[list[Tensor], list[Tensor]]:
        """Client `client`'s query images and `upload`'s clamped renders of them, kept for
        the run's attacks: the folds pair the same shadow clients again and again."""
        if (upload, client) not in self.shadow_renders:
            images, views = [], []
            for task in self.client_tasks(client):
                images += list(as_image_batch(task.query_images(task.query_targets)))
                views += self.rendered(upload, task)
            self.shadow_renders[upload, client] = images, views
        return self.shadow_renders[upload, client]

    def membership_triples(
        self, group: Sequence[int], clamp: bool
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Each client's query images with its own and a random other client's renders."""
        rng = random.Random(self.config.common.seed + len(group))
        images, own, other = [], [], []
        for client in group:
            stranger = rng.choice([c for c in group if c != client] or [client])
            for task in self.client_tasks(client):
                truth = list(as_image_batch(task.query_images(task.query_targets)))
                images += truth
                own += self.rendered(client, task, clamp)
                other += self.rendered(stranger, task, clamp)
        return images, own, other

    def object_folder(self, client: int) -> Path:
        """Client `client`'s object folder under `data-dir`, as its node finds it."""
        return client_object_folder(self.config.deployment.data_dir, client)

    def object_kind(self, client: int) -> str:
        """The kind of client `client`'s object (transforms.json's object name)."""
        meta = json.loads((self.object_folder(client) / "transforms.json").read_text())
        return meta["object"]["name"]

    def property_samples(self, group: Sequence[int], kinds: list[str]) -> tuple[Tensor, Tensor]:
        """Renders of each client's upload, labelled with its object's kind."""
        renders, labels = [], []
        for client in group:
            for task in self.client_tasks(client):
                views = self.rendered(client, task)
                renders += views
                labels += [kinds.index(self.object_kind(client))] * len(views)
        return torch.stack(renders).permute(0, 3, 1, 2), torch.tensor(labels)

    def render_grid(self, state: dict[str, Tensor], uploads: Sequence[Upload]) -> None:
        """Per client: private query image | render of its upload | TTO result from theta."""
        figure = Figure(figsize=(7.5, 2.5 * len(uploads)))
        axes = figure.subplots(len(uploads), 3, squeeze=False)
        for row, upload in zip(axes, uploads, strict=True):
            private = self.client_tasks(upload.client)[0]
            leaked = privacy_metrics(self.model, upload.state, private, with_lpips=False)
            task = CapturedRender(private)
            qualities = tto_qualities(self.model, state, task, self.config, self.settings)
            tto_psnr = qualities[self.steps[-1]]["psnr"]
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
        atomic.save_figure(self.run_dir / "renders.png", figure, dpi=120)


def meta_observers(config: FederatedConfig, run_dir: Path | None = None) -> list[Observer]:
    """The simulation-only audits of a meta run: `PrivacyAudit` when a simulation launcher
    asks for observers (run-config `simulation-audit`), run-config asks for it
    (`privacy-audit`) and uploads are in the clear (no `secure-aggregation`: the server sees
    only sums); else none.

    Its figures go to `run_dir`, by default run-config `run-dir`.
    """
    observed = config.deployment.simulation_audit
    if not (observed and config.meta.privacy_audit and not config.secure.secure_aggregation):
        return []
    if config.common.task == "objects" and not config.deployment.data_dir:
        raise ValueError(
            "run-config 'data-dir' is empty: the objects privacy audit reads the clients' "
            "objects from it (object_NN, as the virtual nodes do)"
        )
    if run_dir is None:
        if not config.common.run_dir:
            raise ValueError(
                "run-config 'run-dir' is empty: the privacy audit writes privacy.png and "
                "renders.png into the run directory, so name it (the launchers do)"
            )
        run_dir = Path(config.common.run_dir)
    return [PrivacyAudit(config, meta_settings(config), run_dir)]


def _first_image(task: MetaTask, values: Tensor) -> np.ndarray:
    """The first image (frame or view) of query-shaped values, [H, W] or [H, W, 3] in [0, 1]."""
    images = task.query_images(values.clamp(0.0, 1.0))
    image = images[0] if images.ndim == 4 else images
    return image[..., 0].numpy() if image.shape[-1] == 1 else image.numpy()


def present(quality: Quality) -> dict[str, float]:
    """The entries with a value (LPIPS is None without the optional package)."""
    return {key: value for key, value in quality.items() if value is not None}


def _plot_privacy(path: Path, history: Sequence[dict[str, Any]]) -> None:
    """PSNR after TTO on held-out tasks (when the server had some) and PSNR_p, per round."""
    if not history:
        return
    rounds = [line["round"] for line in history]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for key, marker, label in (("psnr", "o", "PSNR after TTO"), ("psnr_p", "s", "PSNR_p")):
        if all(key in line for line in history):
            axes.plot(rounds, [line[key] for line in history], marker=marker, label=label)
    axes.set(xlabel="round", ylabel="PSNR (dB)", title="reconstruction and privacy leakage")
    axes.legend()
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=120)
