"""The split-learning job (run-config mode "split"): SplitNeRF with one client over Flower.

The server holds the hash grid and the first density layer (`fedfields.privacy.split`), the
client everything else (`clients.split_client`). Each step is one "train" round trip: the
server embeds the batch the client sent, the client answers with the embedding gradient and
its next batch; the server back-propagates and steps. The server keeps every k-th exchange,
which is all an honest-but-curious server has (the Surrogate Model Attack's input).
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

from clients.split_client import LEARNING_RATE, WEIGHT_DECAY, client_views, joint_field
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
    SplitExchange,
    server_backward,
    server_forward,
    split_field,
)
from fedfields.train.centralised import make_optimizer
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
