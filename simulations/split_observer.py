"""The split job's simulation-only observer: what the honest-but-curious server can recover.

`SplitAudit`, attached by `split_observers` when a simulation launcher sets run-config
`simulation-audit`, watches the wire as the server would, keeping every
`split-record-every`-th exchange (the samples the client sent, the embeddings returned, the
gradient that came back); with `split-attack` it runs the Surrogate Model Attack on that record
at the end and scores it against the client's joint field, which it reads as the experimenter
from the client's state directory, with the scene from run-config `data-dir`. A deployed server
has none of this data and runs without it (the scene and meta jobs' counterparts are
`simulations.scene_observer` and `simulations.meta_observer`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Collection, Iterable
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid
from matplotlib.figure import Figure

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data import Scene
from fedfields.flower.protocol import (
    CONFIG,
    EMBEDDINGS,
    GRADIENT,
    SAMPLES,
    SPLIT_STEP,
    BadReply,
    arrays_to_state,
    checked_samples,
)
from fedfields.privacy import RaySamples, ServerPart, SplitExchange, split_field
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
    TRANSCRIPT_FILE,
    save_transcript,
)
from fedfields.render import RenderConfig
from fedfields.train.builders import client_views, joint_field, split_scene_dir
from fedfields.train.checkpoint import load_checkpoint
from simulations.observers import Observer, ReplyTap


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
