"""The split-learning job (run-config mode "split"): SplitNeRF with one client over Flower.

The server holds the hash grid and the first density layer (`fedfields.privacy.split`), the
client everything else (`clients.split_client`). Both build the joint field from run-config
alone (`joint_field`: the same shapes and seed), so the server reads no file of the client.
Each step is one "train" round trip: the server embeds the batch the client sent, the client
answers with the embedding gradient and its next batch; the server back-propagates and steps.
The run directory gets config.json, metrics.jsonl, summary.json, report.html and TensorBoard
event files (the job skeleton's `new_run_dir` and `RunReport`, `simulations.job`).

In simulation (run-config `simulation-audit`) the split audit (`simulations.split_observer`)
observes the wire as the honest-but-curious server would and attacks what it recorded.
"""

from __future__ import annotations

import json
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedfields.config import FederatedConfig
from fedfields.flower import EmptyRoundsError
from fedfields.flower.protocol import (
    CONFIG,
    DROPPED_PREFIX,
    EMBEDDINGS,
    GRADIENT,
    METRICS,
    SERVER_PART,
    SPLIT_STAGE,
    SPLIT_STEP,
    BadReply,
    arrays_to_state,
    checked_samples,
    state_to_arrays,
)
from fedfields.flower.strategy import wait_for_nodes
from fedfields.optim import make_optimizer
from fedfields.privacy import (
    RaySamples,
    ServerPart,
    server_backward,
    server_forward,
    split_field,
)
from fedfields.privacy.split import (
    SPLIT_LEARNING_RATE,
    SPLIT_WEIGHT_DECAY,
)
from fedfields.tracking import TrackingSettings
from fedfields.train.builders import joint_field, server_device
from simulations.job import RunReport, attach, new_run_dir
from simulations.observers import Observer
from simulations.split_observer import split_observers

LOG_EVERY = 25


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
    """The one client node (waits `timeout` seconds for it to connect, `wait_for_nodes`; more
    than one is refused)."""
    node_ids = wait_for_nodes(grid, 1, timeout)
    if not node_ids:
        raise TimeoutError(f"no client connected within {timeout:g} s (run-config 'round-timeout')")
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
