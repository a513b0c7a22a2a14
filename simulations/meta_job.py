"""The FedMeNF job a ServerApp runs for task faces, photos, video or objects: strategy, rounds,
report.

The server starts from run-config alone and holds no client's data. Each round it writes the
clients' aggregated train metrics (loss, gamma, replies, failures, traffic) and scores the
global meta-learner theta by test-time optimisation (TTO) on public held-out tasks no client
holds: PSNR/SSIM (LPIPS where available) of the query set after 0, 1, 2, 4, ... `tto-steps`
steps on the support set. Faces and video take their held-out tasks from scikit-image's
data; objects from run-config `eval-scene-dir` (without it the server skips TTO).

PSNR_p (FedMeNF Eq. 6) needs the clients' private query images, so it is a simulation-only
observer (`PrivacyAudit`, attached by `meta_observers` when a simulation launcher sets
run-config `simulation-audit`): it sees the train replies through a `ReplyTap` (each
names its client in the CLIENT record), renders each upload w at that client's own query
coordinates and compares with its images, which it reads as the experimenter; the strategy
sees neither.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from matplotlib.figure import Figure
from torch import Tensor, nn

from fedfields import atomic
from fedfields.config import FederatedConfig, MetaSettings, meta_round_sizes, meta_settings
from fedfields.flower import FedMeNF, ProtocolStrategy, StrategyOptions, m_of_n_sampling
from fedfields.flower.fedmenf import GAMMA
from fedfields.flower.protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_INDEX,
    LOCAL_STEPS,
    NUM_FAILURES,
    NUM_REPLIES,
    TRAIN_LOSS,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.resume import resumed_history
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
from fedfields.report import write_report
from fedfields.train.builders import (
    Quality,
    as_image_batch,
    client_meta_tasks,
    client_object_folder,
    heldout_meta_tasks,
    mean_quality,
    meta_model,
    server_device,
    tto_qualities,
    tto_schedule,
)
from fedfields.train.checkpoint import META_CHECKPOINT_FORMAT
from fedfields.train.federated import federated_state
from fedfields.train.meta import privacy_metrics, rescaled_privacy_psnr
from fedfields.train.meta_tasks import MetaTask
from simulations.federated_nerf import (
    open_run_dir,
    privacy_final,
    privacy_report,
    round_checkpointer,
    secure_aggregation_report,
)
from simulations.observers import Observer, ReplyTap, simulation_observed
from strategies import strategy_class

RENDERED_CLIENTS = 4  # rows of the render grid: the last round's first participants
MIN_ATTACK_CLIENTS = 5  # the inference attacks need shadow and target clients
ATTACK_FOLDS = 5  # every client a target once; each attacker trains on the other 4/5


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


class MetaReport:
    """Flower's evaluate_fn for the meta job: one line of metrics.jsonl per round, and the
    final report (checkpoint, tto.png, summary.json, report.html).

    A line holds the clients' aggregated train metrics, theta's TTO quality on the public
    held-out tasks (if any) and what the observers measured.
    """

    def __init__(
        self,
        config: FederatedConfig,
        settings: MetaSettings,
        run_dir: Path,
        strategy: ProtocolStrategy,
        observers: Sequence[Observer],
    ) -> None:
        self.config = config
        self.settings = settings
        self.run_dir = run_dir
        self.strategy = strategy
        self.observers = observers
        self.model = meta_model(config, settings).to(server_device(config))
        self.heldout = heldout_meta_tasks(config, settings)
        if not self.heldout:
            log(
                INFO,
                "fedfields: no public held-out objects (run-config 'eval-scene-dir' is empty): "
                "the server skips test-time optimisation",
            )
        self.steps = tto_schedule(settings.tto_steps)
        self.started = time.perf_counter()
        self.initial: dict[int, Quality] = {}
        self.history: list[dict[str, Any]] = []

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Score theta of `server_round`; from round 1 append a line to metrics.jsonl."""
        curve = self.tto_curve(arrays_to_state(arrays)) if self.heldout else {}
        final = curve.get(self.steps[-1], {})
        if server_round == 0:
            self.initial = curve
            return _metric_record(_present(final))
        metrics: dict[str, Any] = {
            "round": server_round,
            **self.strategy.latest_train_metrics,
            **_present(final),
        }
        if curve:
            metrics["tto"] = {str(step): quality["psnr"] for step, quality in curve.items()}
        for observer in self.observers:
            metrics |= observer.observe_round(server_round, arrays)
        if "psnr" in metrics and "psnr_p" in metrics:
            metrics["delta"] = metrics["psnr"] - metrics["psnr_p"]
        metrics["seconds"] = time.perf_counter() - self.started
        self.history.append(metrics)
        atomic.append_json_line(self.run_dir / "metrics.jsonl", metrics)
        log(INFO, "fedfields round %d: %s", server_round, _headline(metrics, self.steps[-1]))
        return _metric_record(metrics)

    def tto_curve(self, state: dict[str, Tensor]) -> dict[int, Quality]:
        """Mean held-out quality after each scheduled number of TTO steps from `state`."""
        curves = [
            tto_qualities(self.model, state, task, self.config, self.settings)
            for task in self.heldout
        ]
        return {step: mean_quality([curve[step] for curve in curves]) for step in self.steps}

    def finish(self, arrays: ArrayRecord) -> dict[str, Any]:
        """Checkpoint of theta, the TTO plot, the observers' final audits, summary.json and
        report.html."""
        state = arrays_to_state(arrays)
        payload = {
            "format": META_CHECKPOINT_FORMAT,
            "model": {"kind": type(self.model).__name__, **asdict(self.model.config)},
            "state_dict": state,
            "settings": asdict(self.settings),
            "run-config": self.config.to_run_config(),
        }
        atomic.save_torch(self.run_dir / "checkpoint.pt", payload)
        if self.initial:
            _plot_tto(self.run_dir / "tto.png", self.steps, self.initial, self.history)
        summary: dict[str, Any] = {
            "secure-aggregation": secure_aggregation_report(self.config),
            "differential-privacy": privacy_report(self.config, self.strategy),
            "task": self.config.common.task,
            "strategy": self.config.strategy_name,
            "meta-learner": self.config.meta.meta_learner,
            "settings": asdict(self.settings),
            "initial": {str(step): quality for step, quality in self.initial.items()},
            "final": (dict(self.history[-1]) if self.history else {})
            | privacy_final(self.strategy),
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
        self.model = meta_model(config, settings).to(server_device(config))
        self.steps = tto_schedule(settings.tto_steps)
        self.uploads: list[Upload] = []
        self.last_uploads: list[Upload] = []
        self.latest: dict[int, dict[str, Tensor]] = {}  # each client's last upload (App. C)
        self.shadow_renders: dict[tuple[int, int], tuple[list[Tensor], list[Tensor]]] = {}

    def wrap_grid(self, grid: Grid) -> Grid:
        """A `ReplyTap` keeping a copy of each successful train reply's upload."""
        return ReplyTap(grid, self.record)

    def record(self, replies: list[Message]) -> None:
        """Keep the uploads (and their clients) of the successful train replies."""
        for reply in replies:
            if reply.metadata.message_type != MessageType.TRAIN or reply.has_error():
                continue
            if CLIENT in reply.content and ARRAYS in reply.content:
                client = int(reply.content[CLIENT][CLIENT_INDEX])
                self.uploads.append(Upload(client, arrays_to_state(reply.content[ARRAYS])))
                self.latest[client] = self.uploads[-1].state

    def observe_round(self, server_round: int, arrays: ArrayRecord) -> dict[str, Any]:
        """Mean privacy metrics of the round's uploads and the clients they came from."""
        uploads, self.uploads = sorted(self.uploads, key=lambda u: u.client), []
        if not uploads:
            return {}
        self.last_uploads = uploads
        privacy = mean_quality([self.privacy(upload) for upload in uploads])
        return {**_present(privacy), "clients": [upload.client for upload in uploads]}

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
        the figures pool all folds' targets. Empty with fewer than 5 clients."""
        clients = sorted(self.latest)
        if len(clients) < MIN_ATTACK_CLIENTS:
            return {}
        order = random.Random(self.config.common.seed).sample(clients, len(clients))
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


def meta_observers(run_config: Mapping[str, Any], run_dir: Path | None = None) -> list[Observer]:
    """The simulation-only audits of a meta run: `PrivacyAudit` when a simulation launcher
    asks for observers (`simulation_observed`), run-config asks for it (`privacy-audit`) and
    uploads are in the clear (no `secure-aggregation`: the server sees only sums); else none.

    Its figures go to `run_dir`, by default run-config `run-dir`.
    """
    config = FederatedConfig.from_run_config(run_config)
    observed = simulation_observed(dict(run_config))
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
    atomic.save_figure(path, figure, dpi=120)


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


def _headline(metrics: dict[str, Any], tto_steps: int) -> str:
    """The round's main figures for the log."""
    shown = [f"{key} {metrics[key]:.4g}" for key in (TRAIN_LOSS, GAMMA) if key in metrics]
    if "psnr" in metrics:
        shown.append(f"PSNR after {tto_steps} TTO steps {metrics['psnr']:.2f} dB")
    if "psnr_p" in metrics:
        shown.append(f"PSNR_p {metrics['psnr_p']:.2f} dB")
    replies, failures = int(metrics.get(NUM_REPLIES, 0)), int(metrics.get(NUM_FAILURES, 0))
    shown.append(f"{replies} replies, {failures} failures ({metrics['seconds']:.0f} s)")
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
    }
    cls = strategy_class(config.strategy_name)
    if issubclass(cls, FedMeNF):
        return cls(
            clients_per_round=clients,
            num_clients=settings.num_clients,
            min_available_nodes=wanted,
            **cls.own_config(config.to_run_config()),  # reply bounds, aggregation-rule
            **common,
        )
    sampling = m_of_n_sampling(clients, settings.num_clients, wanted)
    return cls.from_config(config.to_run_config(), **common, **sampling)


def run_meta_job(
    grid: Grid, run_config: dict[str, Any], observers: list[Observer] | None = None
) -> Path:
    """Run the FedMeNF job on `grid`; returns the run directory holding the report.

    `observers` None attaches `meta_observers(run_config)`: none unless a simulation launcher
    set run-config `simulation-audit`; [] runs without any.
    """
    config = FederatedConfig.from_run_config(run_config)
    settings = meta_settings(config)
    strategy = make_meta_strategy(config, settings)  # an unknown one fails before any write
    if not config.common.resume:  # a plan beyond dp-target-epsilon, too
        strategy.check_privacy_plan(1, config.common.num_server_rounds)
    run_dir, checkpoint = open_run_dir(config)
    if observers is None:
        observers = meta_observers(run_config, run_dir)
    for observer in observers:
        grid = observer.wrap_grid(grid)
    torch.manual_seed(config.common.seed)
    initial = federated_state(meta_model(config, settings))
    report = MetaReport(config, settings, run_dir, strategy, observers)
    arrays = state_to_arrays(initial)
    if checkpoint is not None:
        if report.heldout:  # round 0's TTO curve, for tto.png (before the RNGs are restored)
            report.initial = report.tto_curve(initial)
        report.history = resumed_history(run_dir, checkpoint.server_round)
        checkpoint.restore(strategy)
        arrays = checkpoint.arrays()
        log(INFO, "fedfields: resuming %s after round %d", run_dir, checkpoint.server_round)
    result = strategy.start(
        grid,
        arrays,
        num_rounds=config.common.num_server_rounds,
        timeout=config.deployment.round_timeout,
        train_config=ConfigRecord({LOCAL_STEPS: settings.outer_steps}),
        evaluate_fn=report,
        first_round=1 if checkpoint is None else checkpoint.server_round + 1,
        round_end_fn=round_checkpointer(run_dir, strategy),
    )
    summary = report.finish(result.arrays)
    log(INFO, "fedfields: secure aggregation %s", json.dumps(summary["secure-aggregation"]))
    log(INFO, "fedfields: final %s", json.dumps(summary["final"]))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir
