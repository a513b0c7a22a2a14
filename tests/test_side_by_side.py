"""Runs side by side (issue 41, point 3): every `python -m simulations.launch` has its own
Flower home and local SuperLink ports, caps its private Ray instance, and stopping it stops
only what it started, so two launches at once both finish; with one seed they are one run
(point 2: users sampled by user key, not by Flower's random node ids)."""

from __future__ import annotations

import asyncio
import errno
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flwr.common.config import parse_config_args
from flwr.simulation.app import _run_simulation_settings
from flwr.supercore.utils import simulation_config_from_json

from simulations import launch
from simulations.launch import default_ray_cpus, federation_config, parse_args
from simulations.planner import (
    FLOWER_HOMES,
    LOOPBACK,
    LocalSuperLink,
    alive,
    launch_home,
    process_tree,
    processes_with_home_under,
    reserved_ports,
    stop_launch,
    superlinks_with_home,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = (
    "strategy='decentnerf' num-server-rounds=2 local-steps=1 orbit-frames=0 target-samples=1024 "
    "hash-log2-size=10 hash-levels=4 client-eval-views=0"
)
"""DecentNeRF for 2 rounds (its gradient query and learned alphas in round 2), 2 of the 3
users a round (fraction-train 0.5), seed 0."""
ANNOUNCED = re.compile(rf"^fedfields: Flower home (\S+), SuperLink {LOOPBACK}:(\d+)$", re.M)
SLEEPER = "import time; time.sleep(600)"


# ------------------------------------------------------------------ homes and ports


def test_two_launches_never_share_a_home_or_a_port() -> None:
    """Both launches' ports are reserved at once (as when they start at the same instant)."""
    run_dir = Path("/somewhere/runs/same-run")
    homes = {launch_home(run_dir, 4242), launch_home(run_dir, 4243)}
    assert len(homes) == 2 and {home.parent for home in homes} == {FLOWER_HOMES}
    with reserved_ports(2) as first, reserved_ports(2) as second:
        assert len({*first, *second}) == 4
        superlink = LocalSuperLink(launch_home(run_dir, 4242), *first)
        assert superlink.environment() == {
            "FLWR_HOME": str(FLOWER_HOMES / "same-run-4242"),
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(first[0]),
            "FLWR_LOCAL_CONTROL_API_PORT": str(first[1]),
        }


def test_a_reserved_port_refuses_others_but_takes_its_superlink() -> None:
    """While held, a plain bind (what hands out a port to anyone else) is refused, and an
    asyncio server (the SuperLink's uvicorn) binds and listens on it."""

    async def serve_once(port: int) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, LOOPBACK, port)
        assert server.sockets[0].getsockname()[1] == port
        server.close()
        await server.wait_closed()

    with reserved_ports(1) as (port,):
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind((LOOPBACK, port))
        assert refused.value.errno == errno.EADDRINUSE
        asyncio.run(serve_once(port))


def test_a_superlink_that_could_not_start_is_tried_again_on_new_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """flwr run's "Failed to start local SuperLink" (a port someone took without reserving):
    the launcher runs it again on a new reservation; any other failure is not retried."""
    outputs = iter(["Failed to start local SuperLink: exited with code 1", "Started run 7\n"])
    homes = []

    def flwr_run(command: list[str], env: dict[str, str]) -> str:
        homes.append(env["FLWR_HOME"])
        return next(outputs)

    monkeypatch.setattr(launch, "_run_streaming", flwr_run)
    monkeypatch.setattr(launch, "run_status", lambda *_: "finished:completed")
    outcome = launch.run_on_own_superlink(["flwr", "run"], {}, tmp_path, "flwr")
    assert (outcome.run_id, outcome.status) == (7, "finished:completed")
    assert homes == [str(tmp_path)] * 2
    monkeypatch.setattr(launch, "_run_streaming", lambda *_: "Invalid run configuration")
    assert launch.run_on_own_superlink(["flwr", "run"], {}, tmp_path, "flwr").run_id is None


# ------------------------------------------------------------------ Ray's cap


def test_ray_cpus_default_to_what_the_federation_runs_at_once() -> None:
    assert default_ray_cpus(nodes=3, client_cpus=1, available=2) == 2
    assert default_ray_cpus(nodes=16, client_cpus=1, available=64) == 16
    assert default_ray_cpus(nodes=10, client_cpus=2, available=7) == 6
    assert default_ray_cpus(nodes=3, client_cpus=4, available=2) == 4  # one client at least


def test_the_cap_reaches_ray_init_through_flowers_federation_config() -> None:
    """The launcher's `--federation-config` as `flwr run` and the simulation runtime read it."""
    flags = parse_config_args([federation_config(3, 1, 0.0, ray_cpus=2)])
    config = simulation_config_from_json({key.replace("-", "_"): v for key, v in flags.items()})
    nodes, _, backend, _, _ = _run_simulation_settings(config)
    assert nodes == 3 and backend["init_args"] == {"num_cpus": 2}
    assert "init-args" not in federation_config(3, 1, 0.0)  # a Ray cluster's own resources


def test_ray_cpus_is_refused_with_a_cluster_or_below_a_client(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert parse_args(["--ray-cpus", "3"]).ray_cpus == 3
    with pytest.raises(SystemExit):
        parse_args(["--ray-cpus", "2", "--ray-address", "127.0.0.1:6379"])
    assert "on the Ray cluster at 127.0.0.1:6379" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--ray-cpus", "1", "--client-cpus", "2"])
    assert "--ray-cpus 1 is below --client-cpus 2" in capsys.readouterr().err


# ------------------------------------------------------------------ stopping


def fake_launch(home: Path) -> list[subprocess.Popen]:
    """Processes as a launch leaves them: a `flower-superlink` with a child (its simulation
    and Ray) and a process outside its tree (a worker Ray re-parented), all with FLWR_HOME."""
    env = {"FLWR_HOME": str(home), "PATH": ""}
    child = f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])"
    parent = f"import subprocess, sys; {child}; {SLEEPER}"
    superlink = subprocess.Popen([sys.executable, "-c", parent, "flower-superlink"], env=env)
    stray = subprocess.Popen([sys.executable, "-c", SLEEPER], env=env)
    while len(process_tree(superlink.pid)) < 2:  # until its child runs
        assert superlink.poll() is None
        time.sleep(0.05)
    return [superlink, stray]


def test_stopping_one_launch_leaves_the_other_running(tmp_path: Path) -> None:
    our_home, their_home = tmp_path / "launch-a", tmp_path / "launch-b"
    ours, theirs = fake_launch(our_home), fake_launch(their_home)
    our_pids = [*process_tree(ours[0].pid), ours[1].pid]
    their_pids = [*process_tree(theirs[0].pid), theirs[1].pid]
    try:
        assert sorted(processes_with_home_under(our_home)) == sorted(our_pids)
        stop_launch(our_home)
        for process in ours:
            process.wait(timeout=30)
        assert not any(alive(pid) for pid in our_pids)
        assert all(alive(pid) for pid in their_pids)
        assert superlinks_with_home(their_home) == [theirs[0].pid]
    finally:
        stop_launch(their_home)
        for process in theirs:
            process.wait(timeout=30)
    assert not any(alive(pid) for pid in their_pids)


# ------------------------------------------------------------------ two launches at once


def test_two_launches_at_once_finish_each_on_its_own_superlink_with_one_run(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """Two tiny launches with one seed started together, as a user types them (one Ray CPU
    each): both exit 0 with their report in their own run directory, announced their own
    Flower home and SuperLink port, and left no process with either home (SuperLink,
    SuperExec, simulation, Ray) and no home behind; and they are one run: the same users
    sampled and summed each round, the same metrics, the same final field bit for bit,
    though Flower gave their nodes other ids (Ray: ~2-3 minutes on 2 cores)."""
    launches, logs = {}, {}
    for name in ("a", "b"):
        command = [sys.executable, "-m", "simulations.launch", "--no-audit", "--ray-cpus", "1"]
        command += ["--crowd", str(crowd_dir), "--run-dir", str(tmp_path / name)]
        command += ["--run-config", TINY]
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as log:
            launches[name] = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True
            )
    homes = {name: launch_home(tmp_path / name, launch.pid) for name, launch in launches.items()}
    try:
        codes = {name: launch.wait(timeout=900) for name, launch in launches.items()}
    finally:
        for name, launch in launches.items():
            if launch.poll() is None:
                launch.terminate()  # the launcher stops what it started
                launch.wait(timeout=60)
            stop_launch(homes[name])
    outputs = {name: log.read_text() for name, log in logs.items()}
    for name in launches:
        assert codes[name] == 0, outputs[name][-3000:]
        assert (tmp_path / name / "summary.json").is_file()
    announced = {name: ANNOUNCED.findall(output) for name, output in outputs.items()}
    assert [len(found) for found in announced.values()] == [1, 1]  # each SuperLink's first try
    assert [Path(found[0][0]) for found in announced.values()] == list(homes.values())
    assert announced["a"][0][1] != announced["b"][0][1]
    for home in homes.values():
        assert processes_with_home_under(home) == []
        assert not home.exists()  # removed once its run completed
    lines = {name: timeless_lines(tmp_path / name / "metrics.jsonl") for name in launches}
    assert [line["round"] for line in lines["a"]] == [1, 2]
    assert all(line["users-sampled"] == line["users-summed"] for line in lines["a"])
    assert len(lines["a"][0]["users-sampled"]) == 2
    assert lines["a"] == lines["b"]
    fields = {name: checkpoint_state(tmp_path / name) for name in launches}
    assert fields["a"].keys() == fields["b"].keys()
    assert all(torch.equal(value, fields["b"][key]) for key, value in fields["a"].items())


def timeless_lines(path: Path) -> list[dict]:
    """metrics.jsonl's lines without wall-clock figures (seconds, client-seconds)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in line.items() if "seconds" not in k} for line in lines]


def checkpoint_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final global field a run saved."""
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["state_dict"]
