"""The split-learning job (run-config mode "split"): SplitNeRF with one client over Flower.

The server holds the hash grid and the first density layer (`fedfields.privacy.split`), the
client everything else (`clients.split_client`). Each step is one "train" round trip: the
server embeds the batch the client sent, the client answers with the embedding gradient and
its next batch; the server back-propagates and steps. The server keeps every k-th exchange,
which is all an honest-but-curious server has; with `split-attack` (simulation only) it runs
the Surrogate Model Attack on that record and scores it against the client's joint field,
which it reads from the client's checkpoint for the audit alone.
"""

from __future__ import annotations

import json
import time
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from matplotlib.figure import Figure

from clients.split_client import LEARNING_RATE, WEIGHT_DECAY, client_views, joint_field
from fedfields.data import Scene
from fedfields.flower_io import (
    CONFIG,
    EMBEDDINGS,
    GRADIENT,
    METRICS,
    SAMPLES,
    SERVER_PART,
    SPLIT_STAGE,
    SPLIT_STEP,
    arrays_to_state,
    state_to_arrays,
)
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
from fedfields.render import RenderConfig
from fedfields.train.centralised import make_optimizer
from fedfields.train.checkpoint import load_checkpoint
from fedfields.train.run_config import FederatedConfig
from simulations.federated_nerf import make_run_dir

LOG_EVERY = 25
NODE_WAIT_SECONDS = 120.0


def run_split_job(grid: Grid, run_config: dict[str, Any]) -> Path:
    """Train by split learning with the grid's one node; returns the run directory."""
    config = FederatedConfig.from_run_config(run_config)
    run_dir = make_run_dir(config)
    (run_dir / "config.json").write_text(json.dumps(config.to_run_config(), indent=2))
    scene, _ = client_views(config.data_dir, config.downscale)  # cameras and box are public
    field = joint_field(config, scene)
    server, _ = split_field(field)
    optimizer = make_optimizer(server, LEARNING_RATE, WEIGHT_DECAY)  # type: ignore[arg-type]
    exchange = _Exchange(grid, _the_node(grid))
    reply = exchange(RecordDict({CONFIG: _config("start")}), "start")
    transcript: list[SplitExchange] = []
    started, history, window = time.perf_counter(), [], []
    for step in range(config.split_steps):
        samples = _samples(reply)
        points = samples.points()
        embeddings = server_forward(server, points)
        content = RecordDict(
            {
                CONFIG: _config("step", step),
                EMBEDDINGS: state_to_arrays({"embeddings": embeddings}),
            }
        )
        reply = exchange(content, f"step {step}")
        gradient = arrays_to_state(reply.content[GRADIENT])["embeddings"]
        if tuple(gradient.shape) != tuple(embeddings.shape) or not torch.isfinite(gradient).all():
            raise ValueError(
                f"step {step}: the client's gradient has shape {tuple(gradient.shape)} or "
                f"non-finite values; expected finite values of shape {tuple(embeddings.shape)}"
            )
        for group in optimizer.param_groups:
            group["lr"] = LEARNING_RATE * 0.1 ** (step / config.split_steps)
        optimizer.zero_grad(set_to_none=True)
        server_backward(server, points, gradient)
        optimizer.step()
        if step % config.split_record_every == 0:
            transcript.append(SplitExchange(step, samples, embeddings, gradient))
        window.append(dict(reply.content[METRICS]))
        if (step + 1) % LOG_EVERY == 0 or step + 1 == config.split_steps:
            history.append(_block(step + 1, window, time.perf_counter() - started))
            window = []
            _append_line(run_dir / "metrics.jsonl", history[-1])
            log(INFO, "split step %d: loss %.4f, psnr %.2f dB", step + 1, *_last(history))
    finish = RecordDict(
        {
            CONFIG: ConfigRecord({SPLIT_STAGE: "finish", "run-dir": str(run_dir.resolve())}),
            SERVER_PART: state_to_arrays(server.state_dict()),
        }
    )
    client_metrics = dict(exchange(finish, "finish").content[METRICS])
    summary: dict[str, Any] = {
        "mode": "split",
        "steps": config.split_steps,
        "seconds": time.perf_counter() - started,
        "client": client_metrics,
        "history": history,
        "transcript-steps": len(transcript),
    }
    if config.split_attack:
        summary["attack"] = attack_audit(config, server, transcript, run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(INFO, "fedfields: split run, client held-out %s", json.dumps(client_metrics))
    log(INFO, "fedfields: run directory %s", run_dir.resolve())
    return run_dir


class _Exchange:
    """One message to the client and its checked reply, per call."""

    def __init__(self, grid: Grid, node_id: int) -> None:
        self.grid, self.node_id = grid, node_id

    def __call__(self, content: RecordDict, what: str) -> Message:
        message = Message(content, dst_node_id=self.node_id, message_type=MessageType.TRAIN)
        replies = list(self.grid.send_and_receive([message], timeout=600.0))
        if not replies:
            raise TimeoutError(f"split {what}: node {self.node_id} did not reply")
        if replies[0].has_error():
            raise RuntimeError(
                f"split {what}: node {self.node_id} failed: {replies[0].error.reason}"
            )
        return replies[0]


def _the_node(grid: Grid) -> int:
    """The one client node (waits for it to connect; more than one is refused)."""
    deadline = time.monotonic() + NODE_WAIT_SECONDS
    while not (node_ids := list(grid.get_node_ids())):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no client connected within {NODE_WAIT_SECONDS:.0f} s")
        time.sleep(1.0)
    if len(node_ids) != 1:
        raise ValueError(f"mode 'split' trains with one client; {len(node_ids)} are connected")
    return node_ids[0]


def _config(stage: str, step: int | None = None) -> ConfigRecord:
    return ConfigRecord({SPLIT_STAGE: stage} | ({} if step is None else {SPLIT_STEP: step}))


def _samples(reply: Message) -> RaySamples:
    """The client's next batch of rays from its reply."""
    rays = arrays_to_state(reply.content[SAMPLES])
    return RaySamples(rays["origins"], rays["directions"], rays["edges"])


def _block(step: int, window: list[dict], seconds: float) -> dict[str, float]:
    """Mean client loss and PSNR over the last steps."""
    return {
        "step": step,
        "seconds": seconds,
        "loss": sum(m["loss"] for m in window) / len(window),
        "psnr": sum(m["psnr"] for m in window) / len(window),
    }


def _last(history: list[dict[str, float]]) -> tuple[float, float]:
    return history[-1]["loss"], history[-1]["psnr"]


def _append_line(path: Path, line: dict[str, float]) -> None:
    with path.open("a") as file:
        file.write(json.dumps(line) + "\n")


def attack_audit(
    config: FederatedConfig, server: ServerPart, transcript: list[SplitExchange], run_dir: Path
) -> dict[str, Any]:
    """Surrogate Model Attack on the server's record, scored on the client's held-out views.

    Simulation only: the truth is the client's joint field from its checkpoint, which the
    attack itself never sees. Also scores an untrained surrogate (the attack's baseline) and
    writes attack.png: true depth | attacked depth | true grey | attacked grey per view.
    """
    scene, heldout = client_views(config.data_dir, config.downscale)
    truth, settings, _, _ = load_checkpoint(run_dir / "checkpoint.pt")
    _, client = split_field(truth)  # type: ignore[arg-type]
    server.eval()
    attack_config = SurrogateAttackConfig(seed=config.seed)
    background = torch.tensor(scene.background, dtype=torch.float32)
    started = time.perf_counter()
    result = surrogate_model_attack(server, transcript, background, attack_config)
    seconds = time.perf_counter() - started
    untrained = make_surrogate_head(server.embedding_dim, attack_config)
    views = list(range(len(heldout)))
    with torch.no_grad():
        attacked = score_attack(server, result.head, client, heldout.cameras, views, settings)
        baseline = score_attack(server, untrained, client, heldout.cameras, views, settings)
        _plot_attack(run_dir / "attack.png", server, result.head, client, heldout, settings)
    log(
        INFO,
        "fedfields: attack SSIM-depth %.3f (untrained surrogate %.3f), SSIM-grey %.3f",
        attacked["ssim_depth"],
        baseline["ssim_depth"],
        attacked["ssim_grey"],
    )
    return {"attacked": attacked, "untrained": baseline, "seconds": seconds}


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
    figure.savefig(path, dpi=100)
