"""Scale: many virtual clients keep their private state on disk, and runs attach to a Ray
cluster someone else started (issue 16)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedfields.data import load_scene
from fedfields.data.crowd import CrowdConfig, build_crowd, write_crowd
from fedfields.train import load_checkpoint
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.planner import replicated_crowd
from simulations.run import client_app
from strategies import parse_app_config

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = 200


@pytest.fixture(scope="module")
def shared_crowd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 users x 2 views of lego at 25x25 shared by CLIENTS clients (links)."""
    lego = load_scene(ROOT / "data" / "lego", downscale=8, background=(0.0, 0.0, 0.0))
    crowd = build_crowd(lego, CrowdConfig(users=2, views_per_user=2, seed=0), progress=False)
    out = tmp_path_factory.mktemp("scale") / "crowd"
    write_crowd(crowd, out)
    return replicated_crowd(out, CLIENTS)


def tiny_job(data_dir: Path, run_dir: Path, state_dir: Path | None) -> dict:
    """DecentNeRF, 2 rounds, 4 of CLIENTS sampled, a 2^10-entry field: seconds, not minutes."""
    config = {
        "data-dir": str(data_dir),
        "run-dir": str(run_dir),
        "strategy": "decentnerf",
        "num-server-rounds": 2,
        "local-steps": 2,
        "fraction-train": 4 / CLIENTS,
        "min-train-nodes": 4,
        "target-samples": 2048,
        "hash-log2-size": 10,
        "hash-levels": 4,
        "client-eval-views": 0,
        "orbit-frames": 0,
    }
    if state_dir is not None:
        config["state-dir"] = str(state_dir)
    return config


def test_idle_clients_hold_no_private_state_in_memory(shared_crowd: Path, tmp_path: Path) -> None:
    on_disk = tiny_job(shared_crowd, tmp_path / "disk", tmp_path / "disk.nodes")
    in_memory = tiny_job(shared_crowd, tmp_path / "memory", None)
    disk_grid = InProcessGrid([client_app(on_disk)] * CLIENTS, raise_errors=True)
    memory_grid = InProcessGrid([client_app(in_memory)] * CLIENTS, raise_errors=True)
    disk_run = run_federated_nerf(disk_grid, parse_app_config(on_disk), observe=False)
    memory_run = run_federated_nerf(memory_grid, parse_app_config(in_memory), observe=False)

    # with state directories no node keeps anything in Flower's in-memory context ...
    assert all(len(context.state) == 0 for context in disk_grid.contexts.values())
    trained = sorted(path.name for path in (tmp_path / "disk.nodes").iterdir())
    assert 4 <= len(trained) <= 8  # only the sampled nodes ever wrote state
    for name in trained:
        kept = {path.name for path in (tmp_path / "disk.nodes" / name).iterdir()}
        assert {"personal-field.pt", "decentnerf-alpha.json"} <= kept
    # ... while without them the same nodes hold it in memory (and no one else does)
    holding = [c.node_config["partition-id"] for c in memory_grid.contexts.values() if c.state]
    assert sorted(f"node_{index:02d}" for index in holding) == trained
    # and the federation computes the same thing either way
    disk_field, memory_field = (
        load_checkpoint(run / "checkpoint.pt")[0] for run in (disk_run, memory_run)
    )
    for (key, value), other in zip(
        disk_field.state_dict().items(), memory_field.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(value, other, msg=key)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def ray_head() -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """A Ray head on 127.0.0.1 started the way a user starts one (`ray start --head`),
    stopped in teardown by signalling the process this fixture started."""
    port = free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="rayff"))  # short: Ray's socket paths are bounded
    ray = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=2",
            "--num-gpus=0",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None, "ray start --head exited"
                assert time.monotonic() < deadline, "the Ray head did not come up in 90 s"
                time.sleep(0.5)
        yield f"127.0.0.1:{port}", head, temp_dir
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # its own session: only its processes
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_job_runs_on_a_ray_head_started_outside_fedfields(
    ray_head: tuple[str, subprocess.Popen, Path], shared_crowd: Path, tmp_path: Path
) -> None:
    address, head, temp_dir = ray_head
    run_dir = tmp_path / "run"
    run_config = (
        "strategy='fedavg' num-server-rounds=1 local-steps=2 fraction-train=0.01 "
        "min-train-nodes=2 orbit-frames=0 target-samples=2048 hash-log2-size=10 hash-levels=4 "
        "client-eval-views=0"
    )
    command = [sys.executable, "-m", "simulations.launch", "--crowd", str(shared_crowd)]
    command += ["--no-audit", "--ray-address", address, "--run-dir", str(run_dir)]
    command += ["--run-config", run_config]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (run_dir / "summary.json").is_file()
    # the job's driver connected to this head (Ray logs one file per driver) ...
    drivers = list(temp_dir.glob("session_*/logs/python-core-driver-*.log"))
    assert drivers, "no driver ever connected to the Ray head"
    # ... and fedfields left the head it did not start running
    assert head.poll() is None
    socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=5).close()
