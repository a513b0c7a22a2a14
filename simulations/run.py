"""Programmatic runs of the fedfields jobs, for tests and benchmarks (no `flwr run` CLI).

Flower's `run_simulation` takes no run-config, and a ClientApp may not change its Context's
run-config (Flower raises ValueError), so both apps are wrapped to see `run_config` through a
new Context that shares the node's id, node-config and persistent state.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from flwr.serverapp import Grid, ServerApp

from clients import client_app as nerf_client
from fedfields.devices import resolve_device
from fedfields.flower.compressed_downloads import compressed_download_mod
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import GRADIENT_QUERY, USER_KEY_ACTION
from fedfields.flower.secure_aggregation import secure_aggregation_mod
from simulations.server_app import run_job
from strategies import parse_app_config


def with_run_config(context: Context, run_config: dict[str, Any]) -> Context:
    """The same node (id, node-config, persistent state) seeing `run_config`."""
    return Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=context.node_config,
        state=context.state,
        run_config=dict(run_config),
    )


def client_app(run_config: dict[str, Any], mods: Sequence[Mod] = ()) -> ClientApp:
    """The ClientApp's handlers and mods (scene or meta tasks, by `task`), seeing `run_config`;
    `mods` go first (outermost), e.g. a benchmark's fault injection."""
    app = ClientApp(mods=[*mods, compressed_download_mod, secure_aggregation_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return nerf_client.train(msg, with_run_config(context, run_config))

    @app.query(GRADIENT_QUERY.split(".", 1)[1])
    def gradient(msg: Message, context: Context) -> Message:
        return nerf_client.gradient(msg, with_run_config(context, run_config))

    app.query(USER_KEY_ACTION)(answer_user_key)
    return app


def server_app(run_config: dict[str, Any], outcome: dict[str, Path]) -> ServerApp:
    """A ServerApp running the job with `run_config`; the run directory lands in `outcome`."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        outcome["run_dir"] = run_job(grid, run_config)

    return app


def run_with_ray(
    run_config: dict[str, Any],
    num_supernodes: int,
    cpus_per_client: float = 1.0,
    mods: Sequence[Mod] = (),
    client_device: str = "auto",
) -> Path:
    """Run the job through Flower's simulation engine (Ray); returns the run directory.

    `client_device` cpu has Ray hide this machine's GPUs from the virtual clients (their
    CUDA_VISIBLE_DEVICES); auto or cuda leaves them visible, where node-config device auto
    (a virtual node has no other) picks them.

    A run-config that cannot sample its rounds from `num_supernodes` nodes (e.g.
    min-train-nodes above it) raises ValueError before anything starts."""
    from flwr.simulation import run_simulation

    parse_app_config(run_config).check_node_count(num_supernodes, "num-supernodes")
    if resolve_device(client_device).type == "cpu" and torch.cuda.is_available():
        os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "1"  # Ray hides the GPUs
    else:
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs to hide
    outcome: dict[str, Path] = {}
    backend = {"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # run_simulation is deprecated in 1.41
        run_simulation(
            server_app=server_app(run_config, outcome),
            client_app=client_app(run_config, mods),
            num_supernodes=num_supernodes,
            backend_config=backend,
        )
    if "run_dir" not in outcome:
        raise RuntimeError("the federated job failed inside the simulation; see the log above")
    return outcome["run_dir"]
