"""The split-learning job (run-config mode "split"): SplitNeRF with one client over Flower.

The server holds the hash grid and the first density layer (`fedfields.privacy.split`), the
client everything else (`clients.split_client`). Both build the joint field from run-config
alone (`joint_field`: the same shapes and seed), so the server reads no file of the client.
Each step is one "train" round trip: the server embeds the batch the client sent, the client
answers with the embedding gradient and its next batch; the server back-propagates and steps.
The run directory gets config.json, metrics.jsonl, summary.json, report.html and TensorBoard
event files (the job skeleton's `new_run_dir` and `RunReport`, `simulations.job`).

In simulation (run-config `simulation-audit`) `SplitAudit` observes the wire as the
honest-but-curious server would, keeping every k-th exchange; with `split-attack` it runs the
Surrogate Model Attack on that record and scores it against the client's joint field, which it
reads as the experimenter from the client's state directory, with the scene from run-config
`data-dir`.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Collection, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from matplotlib.figure import Figure

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data import Scene
from fedfields.flower import EmptyRoundsError
from fedfields.flower.protocol import (
    CONFIG,
    DROPPED_PREFIX,
    EMBEDDINGS,
    GRADIENT,
    METRICS,
    SAMPLES,
    SERVER_PART,
    SPLIT_STAGE,
    SPLIT_STEP,
    BadReply,
    arrays_to_state,
    reply_state,
    state_to_arrays,
)
from fedfields.optim import make_optimizer
from fedfields.privacy import (
    RaySamples,
    ServerPart,
    SplitExchange,
    server_backward,
    server_forward,
    split_field,
)
from fedfields.privacy.attacks import (
    SurrogateAttackConfig,
    make_surrogate_head,
    render_depth_and_grey,
    score_attack,
    surrogate_model_attack,
)
from fedfields.privacy.split import (
    CLIENT_CHECKPOINT,
    CLIENT_RENDERS,
    CLIENT_REPORT,
    SPLIT_LEARNING_RATE,
    SPLIT_WEIGHT_DECAY,
    TRANSCRIPT_FILE,
    save_transcript,
)
from fedfields.render import RenderConfig
from fedfields.tracking import TrackingSettings
from fedfields.train.builders import client_views, joint_field, server_device, split_scene_dir
from fedfields.train.checkpoint import load_checkpoint
from simulations.job import RunReport, attach, new_run_dir
from simulations.observers import Observer, ReplyTap

LOG_EVERY = 25
NODE_POLL_SECONDS = 0.2


def run_split_job(
    grid: Grid, config: FederatedConfig, observers: list[Observer] | None = None
) -> Path:
    """Train by split learning with the grid's one node; returns the run directory.

    `observers` None attaches `split_observers(config)`: none unless a simulation launcher set
    run-config `simulation-audit`; [] runs without any. MLflow asked for and not installed
    (`fedfields.tracking`) is refused before anything is written.
    """
    tracking = TrackingSettings.from_environ()
    run_dir = new_run_dir(config)
    if observers is None:
        observers = split_observers(config, run_dir)
    grid = attach(grid, observers)
    server, _ = split_field(joint_field(config).to(server_device(config)))
    timeout = config.deployment.round_timeout  # run-config round-timeout, per exchange
    exchange = _Exchange(grid, _the_node(grid, timeout), timeout)
    reply = exchange(RecordDict({CONFIG: _config("start")}), "start")
    report = RunReport(run_dir, observers)
    with report.tracking(config, tracking):
        client_metrics = _train(config, server, exchange, reply, report)
    log(INFO, "fedfields: split run, client held-out %s", json.dumps(client_metrics))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir


def _train(
    config: FederatedConfig,
    server: ServerPart,
    exchange: _Exchange,
    reply: Message,
    report: RunReport,
) -> dict[str, Any]:
    """The split steps from the client's first batch (`reply`), the finish exchange, then
    summary.json and report.html; returns the client's held-out metrics."""
    device = server_device(config)
    optimizer = make_optimizer(server, SPLIT_LEARNING_RATE, SPLIT_WEIGHT_DECAY)
    observers, window = report.observers, []
    for step in range(config.split.split_steps):
        points = _samples(reply, config, step).points().to(device)
        embeddings = server_forward(server, points)
        content = RecordDict(
            {
                CONFIG: _config("step", step),
                EMBEDDINGS: state_to_arrays({"embeddings": embeddings}),
            }
        )
        reply = exchange(content, f"step {step}")
        gradient = arrays_to_state(reply.content[GRADIENT])["embeddings"].to(device)
        if tuple(gradient.shape) != tuple(embeddings.shape) or not torch.isfinite(gradient).all():
            raise ValueError(
                f"step {step}: the client's gradient has shape {tuple(gradient.shape)} or "
                f"non-finite values; expected finite values of shape {tuple(embeddings.shape)}"
            )
        for group in optimizer.param_groups:
            group["lr"] = SPLIT_LEARNING_RATE * 0.1 ** (step / config.split.split_steps)
        optimizer.zero_grad(set_to_none=True)
        server_backward(server, points, gradient)
        optimizer.step()
        window.append(dict(reply.content[METRICS]))
        if (step + 1) % LOG_EVERY == 0 or step + 1 == config.split.split_steps:
            line = _block(step + 1, window, time.perf_counter() - report.started)
            window = []
            if observers:
                line |= report.observe(step + 1, state_to_arrays(server.state_dict()))
            report.append_line(line)
            log(INFO, "split step %d: loss %.4f, psnr %.2f dB", step + 1, *_last(report.history))
    finish = RecordDict(
        {
            CONFIG: _config("finish"),
            SERVER_PART: state_to_arrays(server.state_dict()),
        }
    )
    client_metrics = dict(exchange(finish, "finish").content[METRICS])
    summary: dict[str, Any] = {
        "mode": "split",
        "steps": config.split.split_steps,
        "seconds": time.perf_counter() - report.started,
        "client": client_metrics,
        "history": report.history,
    }
    if observers:
        report.finish_observers(state_to_arrays(server.state_dict()), summary)
    report.write(summary)
    return client_metrics


class _Exchange:
    """One message to the client and its checked reply within `timeout` seconds, per call."""

    def __init__(self, grid: Grid, node_id: int, timeout: float) -> None:
        self.grid, self.node_id, self.timeout = grid, node_id, timeout

    def __call__(self, content: RecordDict, what: str) -> Message:
        message = Message(content, dst_node_id=self.node_id, message_type=MessageType.TRAIN)
        replies = list(self.grid.send_and_receive([message], timeout=self.timeout))
        if not replies:
            raise TimeoutError(
                f"split {what}: node {self.node_id} did not reply within {self.timeout:g} s "
                "(run-config 'round-timeout')"
            )
        if replies[0].has_error():
            raise RuntimeError(
                f"split {what}: node {self.node_id} failed: {replies[0].error.reason}"
            )
        return replies[0]


def _the_node(grid: Grid, timeout: float) -> int:
    """The one client node (waits `timeout` seconds for it to connect; more than one is
    refused)."""
    deadline = time.monotonic() + timeout
    while not (node_ids := list(grid.get_node_ids())):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no client connected within {timeout:g} s (run-config 'round-timeout')"
            )
        time.sleep(NODE_POLL_SECONDS)
    if len(node_ids) != 1:
        raise ValueError(f"mode 'split' trains with one client; {len(node_ids)} are connected")
    return node_ids[0]


def _config(stage: str, step: int | None = None) -> ConfigRecord:
    return ConfigRecord({SPLIT_STAGE: stage} | ({} if step is None else {SPLIT_STEP: step}))


def _samples(reply: Message, config: FederatedConfig, step: int) -> RaySamples:
    """The client's batch for `step`, checked like a strategy checks a reply's arrays: keys,
    shapes (R rays, 1 <= R <= split-batch-rays, split-samples bins), float dtype, finite
    values. A bad batch is logged and ends the run with one `EmptyRoundsError` naming the
    check: the server must not embed it, and the next step needs exactly this batch."""
    try:
        rays = checked_samples(reply, config.split.split_batch_rays, config.split.split_samples)
    except BadReply as bad:
        node = reply.metadata.src_node_id
        log(
            WARNING,
            "split step %d: sample reply of node %d dropped (check %r)",
            step,
            node,
            bad.check,
        )
        raise EmptyRoundsError(
            f"split step {step}: the client's sample reply was dropped ({DROPPED_PREFIX}"
            f"{bad.check} 1): {bad}; split learning cannot go on without its batch"
        ) from None
    return RaySamples(rays["origins"], rays["directions"], rays["edges"])


def checked_samples(reply: Message, max_rays: int, samples: int) -> dict[str, torch.Tensor]:
    """The SAMPLES record as float32 tensors, or `BadReply`: "origins" and "directions"
    [R, 3], "edges" [R, samples + 1], 1 <= R <= max_rays, finite (`reply_state`)."""
    record = reply.content.get(SAMPLES)
    origins = record.get("origins") if isinstance(record, ArrayRecord) else None
    count = origins.shape[0] if origins is not None and len(origins.shape) == 2 else 1
    if not 1 <= count <= max_rays:
        raise BadReply(
            "batch-size",
            f"reply from node {reply.metadata.src_node_id}, record {SAMPLES!r}: {count} rays, "
            f"outside [1, split-batch-rays = {max_rays}]",
        )
    shapes = {"origins": (count, 3), "directions": (count, 3), "edges": (count, samples + 1)}
    return reply_state(reply, SAMPLES, shapes, dict.fromkeys(shapes, "float32"))


def _block(step: int, window: list[dict], seconds: float) -> dict[str, Any]:
    """Mean client loss and PSNR over the last steps."""
    return {
        "step": step,
        "seconds": seconds,
        "loss": sum(m["loss"] for m in window) / len(window),
        "psnr": sum(m["psnr"] for m in window) / len(window),
    }


def _last(history: list[dict[str, Any]]) -> tuple[float, float]:
    return history[-1]["loss"], history[-1]["psnr"]


def split_observers(config: FederatedConfig, run_dir: Path | None = None) -> list[Observer]:
    """The simulation-only audits of a split run: `SplitAudit` when a simulation launcher asks
    for observers (run-config `simulation-audit`), else none (a deployed server reads no user
    file).

    It reads the scene from run-config `data-dir` and the client's joint field from
    `<state-dir>/node_00`, and writes into `run_dir` (default run-config `run-dir`).
    """
    if not config.deployment.simulation_audit:
        return []
    for key, value, why in (
        (
            "data-dir",
            config.deployment.data_dir,
            "the client's scene (the attack's held-out views)",
        ),
        (
            "state-dir",
            config.deployment.state_dir,
            "the client's node_00 directory (its joint field)",
        ),
        ("run-dir", str(run_dir or config.common.run_dir), "the report's directory"),
    ):
        if not value:
            raise ValueError(f"run-config {key!r} is empty: the split audit needs {why}")
    return [SplitAudit(config, Path(run_dir or config.common.run_dir))]


class SplitAudit:
    """Simulation-only observer of a split run: the client's renders, checkpoint and
    client.json copied into the run directory and, with `split-attack`, the Surrogate Model
    Attack on every `split-record-every`-th exchange seen on the wire (`attack.png`); that
    record, what the honest-but-curious server saw and never client state, is kept as
    transcript.pt for the post-hoc attacks of `fedfields audit`.

    As the experimenter it reads the client's scene (run-config `data-dir`: the scene, or its
    scene_00) and the client's state directory (`<state-dir>/node_00`, `fedfields.flower.node`).
    """

    def __init__(self, config: FederatedConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.scene_dir = split_scene_dir(config.deployment.data_dir)
        self.client_dir = Path(config.deployment.state_dir) / "node_00"
        self.transcript: list[SplitExchange] = []
        self.samples: RaySamples | None = None  # the batch the client sent last
        self.recorded: tuple[int, torch.Tensor] | None = None  # (step, embeddings) in flight

    def wrap_grid(self, grid: Grid) -> Grid:
        """A tap showing the audit each step's embeddings and the client's replies."""
        if not self.config.split.split_attack:
            return grid
        return _WireTap(grid, self.sent, self.received)

    def sent(self, messages: list[Message]) -> None:
        """Keep the embeddings of a recorded step until its gradient comes back."""
        for message in messages:
            step = message.content[CONFIG].get(SPLIT_STEP)
            if step is not None and int(step) % self.config.split.split_record_every == 0:
                embeddings = arrays_to_state(message.content[EMBEDDINGS])["embeddings"]
                self.recorded = (int(step), embeddings)

    def received(self, replies: list[Message]) -> None:
        """Record (samples, embeddings, gradient) of a recorded step; keep the next batch."""
        for reply in replies:
            if reply.has_error():
                continue
            if GRADIENT in reply.content and self.recorded is not None:
                step, embeddings = self.recorded
                gradient = arrays_to_state(reply.content[GRADIENT])["embeddings"]
                if self.samples is None:
                    raise RuntimeError(f"split audit: step {step} before any batch of rays")
                self.transcript.append(SplitExchange(step, self.samples, embeddings, gradient))
                self.recorded = None
            if SAMPLES in reply.content:
                split = self.config.split
                try:
                    rays = checked_samples(reply, split.split_batch_rays, split.split_samples)
                except BadReply:  # the server drops this batch and stops: nothing to record
                    continue
                self.samples = RaySamples(rays["origins"], rays["directions"], rays["edges"])

    def observe_round(
        self, server_round: int, arrays: ArrayRecord, accepted: Collection[int] = ()
    ) -> dict[str, Any]:
        """Nothing per block: the attack runs once, on the whole record."""
        return {}

    def finish(self, arrays: ArrayRecord, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Copy the client's report into the run directory; run and score the attack."""
        if not (self.client_dir / CLIENT_CHECKPOINT).is_file():
            raise FileNotFoundError(
                f"split audit: no {CLIENT_CHECKPOINT} in the client's state directory "
                f"{self.client_dir} (run-config 'state-dir' {self.config.deployment.state_dir!r})"
            )
        for name in (CLIENT_CHECKPOINT, CLIENT_REPORT):
            shutil.copy2(self.client_dir / name, self.run_dir / name)
        shutil.copytree(
            self.client_dir / CLIENT_RENDERS, self.run_dir / CLIENT_RENDERS, dirs_exist_ok=True
        )
        if not self.config.split.split_attack:
            return {}
        save_transcript(self.run_dir / TRANSCRIPT_FILE, self.transcript)
        server, _ = split_field(joint_field(self.config))
        server.load_state_dict(arrays_to_state(arrays))
        return {"attack": self.attack(server)}

    def attack(self, server: ServerPart) -> dict[str, Any]:
        """Surrogate Model Attack on the recorded exchanges, scored on the held-out views.

        The truth is the client's joint field from its checkpoint, which the attack itself
        never sees. Also scores an untrained surrogate (the attack's baseline) and writes
        attack.png: true depth | attacked depth | true grey | attacked grey per view.
        """
        scene, heldout = client_views(str(self.scene_dir), self.config.common.downscale)
        truth, settings, _, _ = load_checkpoint(self.client_dir / CLIENT_CHECKPOINT)
        _, client = split_field(truth)  # type: ignore[arg-type]
        server.eval()
        attack_config = SurrogateAttackConfig(seed=self.config.common.seed)
        background = torch.tensor(scene.background, dtype=torch.float32)
        started = time.perf_counter()
        result = surrogate_model_attack(server, self.transcript, background, attack_config)
        seconds = time.perf_counter() - started
        untrained = make_surrogate_head(server.embedding_dim, attack_config)
        views = list(range(len(heldout)))
        with torch.no_grad():
            attacked = score_attack(server, result.head, client, heldout.cameras, views, settings)
            baseline = score_attack(server, untrained, client, heldout.cameras, views, settings)
            _plot_attack(
                self.run_dir / "attack.png", server, result.head, client, heldout, settings
            )
        log(
            INFO,
            "fedfields: attack SSIM-depth %.3f (untrained surrogate %.3f), SSIM-grey %.3f",
            attacked["ssim_depth"],
            baseline["ssim_depth"],
            attacked["ssim_grey"],
        )
        return {
            "attacked": attacked,
            "untrained": baseline,
            "seconds": seconds,
            "transcript-steps": len(self.transcript),
        }


class _WireTap(ReplyTap):
    """A `ReplyTap` that also shows the messages the server sends to `on_sent`."""

    def __init__(
        self,
        grid: Grid,
        on_sent: Callable[[list[Message]], None],
        on_replies: Callable[[list[Message]], None],
    ) -> None:
        super().__init__(grid, on_replies)
        self.on_sent = on_sent

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Show the messages, then push them through the wrapped grid."""
        messages = list(messages)
        self.on_sent(messages)
        return super().push_messages(messages)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Show the messages, then send and receive through the wrapped grid."""
        messages = list(messages)
        self.on_sent(messages)
        return super().send_and_receive(messages, timeout=timeout)


def _plot_attack(
    path: Path,
    server: ServerPart,
    attack_head: torch.nn.Module,
    client: torch.nn.Module,
    heldout: Scene,
    settings: RenderConfig,
    views: int = 3,
) -> None:
    """Rows of held-out views: true depth, attacked depth, true grey, attacked grey."""
    shown = range(min(views, len(heldout)))
    figure = Figure(figsize=(8, 2.2 * len(shown)))
    axes = figure.subplots(len(shown), 4, squeeze=False)
    titles = ("client depth", "attack depth", "client grey", "attack grey")
    for row, view in zip(axes, shown, strict=True):
        true_depth, true_grey = render_depth_and_grey(
            server, client, heldout.cameras, view, settings
        )
        depth, grey = render_depth_and_grey(server, attack_head, heldout.cameras, view, settings)
        for axis, image, title in zip(
            row, (true_depth, depth, true_grey, grey), titles, strict=True
        ):
            axis.imshow(image.numpy(), cmap="gray", vmin=0.0, vmax=1.0)
            axis.set_title(title, fontsize=8)
            axis.axis("off")
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=100)
