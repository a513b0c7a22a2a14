"""`python -m simulations.launch`: a federated run, by `flwr run .` through Ray.

It does what a careful user of Flower 1.41 does by hand (docs/SIMULATION.md): gives the launch
its own Flower home (.flwr-home/<run-dir name>-<pid>) and free ports for the local SuperLink
`flwr run` starts, so launches run side by side; hands `flwr run` a copy of the files it
packages (<home>/app: the same FAB, without Flower's walk through .venv); caps the private Ray
instance at the CPUs the launch asks for (`--ray-cpus`); forbids run-time dependency
installation (which would pull a CUDA torch), builds the run-config `task`'s dataset once (the
crowdsourced scene, or the object collection for FedMeNF's objects; faces and video come
with scikit-image) and passes absolute paths (app bundles carry no images), starts one
virtual SuperNode per user or client, streams the logs, then asks the SuperLink whether the
run completed, since
`flwr run` exits 0 even when the ServerApp fails, and stops what it started (by its Flower
home, also on Ctrl-C and SIGTERM), never another launch's processes.
As the experimenter it attaches the simulation-only observers (`simulation-audit`), which
read the data root's ground truth, and gives virtual node i its private state directory
`<run-dir>.nodes/node_NN` (`state-dir`), outside the server's run directory. The nodes and
their data come from `simulations.planner`, which `simulations.deploy` shares.
Devices: with `--client-gpus F` Ray gives each virtual client an F share of a GPU and makes it
visible to that client alone (CUDA_VISIBLE_DEVICES), and its node-config device auto picks it;
without CUDA here the launcher refuses rather than train on the CPU. With no GPU share a client
sees no GPU and trains on the CPU. The ServerApp uses run-config `server-device`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

import torch
from flwr.common.config import parse_config_args

from fedfields.config import FederatedConfig, without_ignored_keys
from fedfields.flower.resume import read_run_config
from simulations import APP_DIR
from simulations.planner import (
    ENVIRONMENT,
    LOOPBACK,
    DataOptions,
    LocalSuperLink,
    as_run_config,
    failure_line,
    fresh_home,
    job_config,
    launch_home,
    plan_nodes,
    reserved_ports,
    run_id_of,
    run_status,
    staged_app,
    stop_launch,
)

LAUNCHER_KEYS = ("run-dir", "data-dir", "state-dir", "simulation-audit", "min-available-nodes")
SUPERLINK_START_ATTEMPTS = 3
SUPERLINK_START_FAILED = "Failed to start local SuperLink"  # flwr run's words when it could not


@dataclass(frozen=True)
class RunOutcome:
    """What `flwr run` left: the run id (None when no run started), its final status, output."""

    run_id: int | None
    status: str
    output: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.launch",
        description="Run a fedfields job with `flwr run .` on virtual SuperNodes (Ray).",
    )
    parser.add_argument("--scene", type=Path, default=APP_DIR / "data" / "lego")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--views-per-user", type=int, default=5)
    parser.add_argument("--downscale", type=float, default=2.0, help="of the scene's images")
    parser.add_argument("--crowd", type=Path, default=None, help="crowd dataset (built if missing)")
    parser.add_argument(
        "--clients",
        type=int,
        default=None,
        help="scene job: this many virtual clients sharing the crowd's users' photos round robin "
        "(each with its own private state); default one per user",
    )
    parser.add_argument("--object-views", type=int, default=16, help="views per object")
    parser.add_argument("--object-resolution", type=int, default=32, help="object image size")
    parser.add_argument(
        "--objects", type=Path, default=None, help="object collection (built if missing)"
    )
    parser.add_argument(
        "--run-config",
        default="",
        help="extra run-config, e.g. \"strategy='fedavg'\" or \"task='faces'\"",
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="default runs/<time>-<strategy>")
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last completed round, with its settings",
    )
    parser.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS"),
        help="run on this existing Ray cluster (e.g. 127.0.0.1:6379; default $RAY_ADDRESS) "
        "instead of a private Ray instance; the cluster is left running",
    )
    parser.add_argument(
        "--client-cpus", type=int, default=1, help="CPUs per virtual client (Ray actor)"
    )
    parser.add_argument(
        "--ray-cpus",
        type=int,
        default=None,
        help="CPUs of the private Ray instance this launch starts (ray.init's num_cpus): Ray "
        "runs at most this / --client-cpus clients at once and leaves the rest of the machine "
        "to other launches; default --client-cpus x min(nodes, this process's CPUs / "
        "--client-cpus), at least one client's; not with --ray-address, where the cluster's "
        "own resources apply",
    )
    parser.add_argument(
        "--client-gpus",
        type=float,
        default=0.0,
        help="GPUs per virtual client, e.g. 0.25: every client trains on CUDA (0: on the CPU)",
    )
    parser.add_argument(
        "--no-audit",
        action="store_true",
        help="attach no simulation observer (large runs: the audit loads every user's photos)",
    )
    args = parser.parse_args(argv)
    if args.client_cpus < 1:
        parser.error(f"--client-cpus must be a positive integer, got {args.client_cpus}")
    if args.ray_cpus is not None and args.ray_address:
        parser.error(
            f"--ray-cpus caps the private Ray instance a launch starts; on the Ray cluster at "
            f"{args.ray_address} (--ray-address or $RAY_ADDRESS) its own resources apply"
        )
    if args.ray_cpus is not None and args.ray_cpus < args.client_cpus:
        parser.error(
            f"--ray-cpus {args.ray_cpus} is below --client-cpus {args.client_cpus}: "
            "no client could run"
        )
    if args.client_gpus < 0:
        parser.error(f"--client-gpus must be >= 0, got {args.client_gpus}")
    if args.client_gpus > 0 and not args.ray_address and not torch.cuda.is_available():
        parser.error(
            f"--client-gpus {args.client_gpus:g}: no CUDA device is visible on this machine "
            "(torch.cuda.is_available() is False), so the virtual clients would train on the "
            "CPU; leave --client-gpus out, or run where a GPU is (or name a Ray cluster that "
            "has one with --ray-address)"
        )
    return args


def resumed_run_config(run_dir: Path, extra: str) -> str:
    """The run-config of the run in `run_dir` (its config.json, less the keys it never read)
    with resume=true, then `extra`."""
    saved = {
        **without_ignored_keys(read_run_config(run_dir)),
        "resume": True,
    }  # ResumeError if missing or damaged
    return f"{as_run_config(saved)} {extra}"


def user_overrides(run_config: str) -> str:
    """The user's run-config without the keys the launcher resolves (`LAUNCHER_KEYS`)."""
    overrides = parse_config_args([run_config]) if run_config.strip() else {}
    return as_run_config({key: v for key, v in overrides.items() if key not in LAUNCHER_KEYS})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # flwr starts `flower-superlink` by name: the venv's scripts must come first on PATH.
    scripts = str(Path(sys.executable).parent)
    env = {**os.environ, **ENVIRONMENT, "PATH": f"{scripts}:{os.environ.get('PATH', '')}"}
    if args.client_gpus == 0 and torch.cuda.is_available():
        env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "1"  # Ray hides the GPUs: clients on the CPU
    try:
        if args.resume is not None:
            args.run_config = resumed_run_config(args.resume.resolve(), args.run_config)
        config = job_config(args.run_config)
        nodes = plan_nodes(config, DataOptions.from_args(args), env, clients=args.clients)
        # e.g. min-train-nodes above the nodes started, before anything runs
        config.check_node_count(nodes.count, "num-supernodes")
    except ValueError as error:
        print(f"fedfields: {error}", file=sys.stderr)
        return 2
    if args.clients is not None and config.common.task == "scene":
        args.no_audit = True  # the audit's ground truth is per user, not per shared client
        print(f"fedfields: {args.clients} clients share the photos in {nodes.data_root} (no audit)")
    run_dir = launch_run_dir(args.run_dir, config, nodes.name)
    state_dir = run_dir.with_name(run_dir.name + ".nodes")
    run_config = f"run-dir={json.dumps(str(run_dir))} state-dir={json.dumps(str(state_dir))}"
    audit = "false" if args.no_audit else "true"
    run_config += f" simulation-audit={audit} min-available-nodes={nodes.count}"
    if nodes.data_root is not None:
        run_config = f"data-dir={json.dumps(str(nodes.data_root))} {run_config}"
    if nodes.eval_scene_dir is not None and not config.common.eval_scene_dir:
        run_config += f" eval-scene-dir={json.dumps(str(nodes.eval_scene_dir))}"
    if config.common.mode == "split" and "downscale" not in parse_config_args([args.run_config]):
        run_config += f" downscale={float(args.downscale)}"  # the raw scene, like the crowd's
    ray_cpus = None
    if not args.ray_address:
        available = len(os.sched_getaffinity(0))
        ray_cpus = args.ray_cpus or default_ray_cpus(nodes.count, args.client_cpus, available)
    federation = federation_config(nodes.count, args.client_cpus, args.client_gpus, ray_cpus)
    # read by the simulation runtime's ray.init: the cluster, or a new private instance even
    # where `ray start` left a cluster that Ray would otherwise join
    env["RAY_ADDRESS"] = args.ray_address or "local"
    flwr = str(Path(sys.executable).with_name("flwr"))
    home = fresh_home(launch_home(run_dir))
    app = staged_app(APP_DIR, home / "app")  # the files Flower packages, without its long walk
    command = [flwr, "run", str(app), "--stream", "--federation-config", federation]
    command += ["--run-config", f"{run_config} {user_overrides(args.run_config)}".strip()]
    print("$", " ".join(shlex.quote(part) for part in command), flush=True)
    outcome = run_and_clean_up(command, env, home, flwr)
    if outcome.run_id is None:
        print(
            f"fedfields: flwr run did not start a run; this launch's Flower home, with the "
            f"SuperLink's log, is kept in {home}",
            file=sys.stderr,
        )
        return 1
    if outcome.status != "finished:completed":
        print(failure_line(outcome.run_id, outcome.status, outcome.output), file=sys.stderr)
        return 1
    print(f"fedfields: report in {run_dir}")
    return 0


def launch_run_dir(given: Path | None, config: FederatedConfig, job: str) -> Path:
    """The run directory: `--run-dir`, run-config's `run-dir`, else a new
    runs/<UTC time>-<job> (`claimed_run_dir`)."""
    if given is not None or config.common.run_dir:
        return Path(given or config.common.run_dir).resolve()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return claimed_run_dir(APP_DIR / "runs" / f"{stamp}-{job}")


def claimed_run_dir(base: Path) -> Path:
    """`base`, else `base`-2, -3, ...: the first that did not exist, created here, so launches
    started in the same second get a default run directory each."""
    path, number = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path.resolve()
        except FileExistsError:
            number += 1
            path = base.with_name(f"{base.name}-{number}")


def run_and_clean_up(command: list[str], env: dict[str, str], home: Path, flwr: str) -> RunOutcome:
    """`run_on_own_superlink`, then stop what this launch started (`flwr run` leaves its
    SuperLink running) and remove its Flower home, unless no run started (the SuperLink's
    log there says why); SIGTERM, like Ctrl-C, ends the launch through this clean-up."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    keep = False
    try:
        outcome = run_on_own_superlink(command, env, home, flwr)
        keep = outcome.run_id is None
        return outcome
    finally:
        stop_launch(home)
        signal.signal(signal.SIGTERM, previous)
        if not keep:
            shutil.rmtree(home, ignore_errors=True)


def run_on_own_superlink(
    command: list[str], env: dict[str, str], home: Path, flwr: str
) -> RunOutcome:
    """`flwr run` (`command`) on a local SuperLink of this launch alone: Flower home `home`,
    free ports held reserved until the run's status is known. When the SuperLink could not
    start (a port taken by a process that bound it without reserving), again on new ports,
    up to SUPERLINK_START_ATTEMPTS times."""
    output = ""
    for attempt in range(1, SUPERLINK_START_ATTEMPTS + 1):
        with reserved_ports(2) as (http_port, control_port):
            superlink = LocalSuperLink(home, http_port, control_port)
            run_env = {**env, **superlink.environment()}
            print(f"fedfields: Flower home {home}, SuperLink {LOOPBACK}:{http_port}", flush=True)
            output = _run_streaming(command, run_env)
            run_id = run_id_of(output)
            if run_id is not None:
                return RunOutcome(run_id, run_status(flwr, run_id, run_env), output)
        if SUPERLINK_START_FAILED not in output:
            break
        print(f"fedfields: the SuperLink did not start (try {attempt}); new ports", flush=True)
        stop_launch(home)
    return RunOutcome(None, "not-started", output)


def default_ray_cpus(nodes: int, client_cpus: int, available: int) -> int:
    """CPUs for a launch's private Ray instance: room for all `nodes` clients at once, but no
    more clients than `available` CPUs hold (at least one client)."""
    return client_cpus * max(1, min(nodes, available // client_cpus))


def federation_config(
    num_nodes: int, client_cpus: int, client_gpus: float, ray_cpus: int | None = None
) -> str:
    """Flower's simulation settings: one virtual SuperNode per client, each client's Ray
    resources (CPUs must be whole: Flower 1.41's `flwr run` takes no fractional CPUs) and,
    for a private Ray instance, its CPUs (`init-args-num-cpus`: ray.init's num_cpus)."""
    config = f"num-supernodes={num_nodes} client-resources-num-cpus={client_cpus}"
    config += f" client-resources-num-gpus={client_gpus:g}"
    return config if ray_cpus is None else f"{config} init-args-num-cpus={ray_cpus}"


def _terminate(signum: int, _: FrameType | None) -> None:
    """SIGTERM: leave through `run_and_clean_up`'s clean-up (this launch's processes stopped)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _run_streaming(command: list[str], env: dict[str, str]) -> str:
    """Run `command`, echoing its output live; returns the output."""
    process = subprocess.Popen(
        command, cwd=APP_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    process.wait()
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
