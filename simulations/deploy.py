"""`python -m simulations.deploy`: a real Flower deployment of a fedfields job on 127.0.0.1.

It starts what an operator starts on separate machines, here on one: one `flower-superlink`
serving its APIs over TLS (certificates from `simulations.certificates`) and one
`flower-supernode` per user, each given only its own data folder and a private state folder
by `--node-config`; then `flwr run <app> <federation> --stream` (<app>: the deployment's copy
of the files Flower packages, `planner.staged_app`) with the CLI trusting the
CA through its own $FLWR_HOME/config.toml. The ServerApp's run-config names no data and no
state directory: the server holds no user's data. Every process gets its own FLWR_HOME
under the deployment directory (certificates, homes, node state and logs), runtime
dependency installation is off everywhere (a SuperLink would `uv sync` a CUDA torch), and
the launcher stops exactly the processes it started, by PID and with their whole process
trees, also on Ctrl-C, SIGTERM and failure. `flwr run` exits 0 even when the ServerApp
fails, so the exit status comes from the SuperLink's record of the run. Which node holds
which folder, the run's status and the process trees come from `simulations.planner`, which
`simulations.launch` shares.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import IO

from flwr.common.config import parse_config_args

from fedfields.config.schema import META_TASKS
from fedfields.devices import DEVICE_CHOICES, parse_device
from simulations import APP_DIR
from simulations.certificates import TlsFiles, write_tls_files
from simulations.planner import (
    ENVIRONMENT,
    DataOptions,
    NodePlan,
    as_run_config,
    failure_line,
    job_config,
    plan_nodes,
    process_tree,
    processes_with_home_under,
    run_id_of,
    run_status,
    staged_app,
    stop_pids,
)

FEDERATION = "fedfields-deploy"
LOCAL_HOST = "127.0.0.1"
# Run-config keys that name a node's files: a deployed node gets them from --node-config.
NODE_KEYS = ("data-dir", "state-dir")


@dataclass(frozen=True)
class RunOutcome:
    """What `flwr run` left: the run id (None when no run started), its final status, output."""

    run_id: int | None
    status: str
    output: str


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago (bound to port 0)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((LOCAL_HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def node_config_text(
    partition_id: int,
    num_partitions: int,
    data_dir: Path | None,
    state_dir: Path,
    device: str = "auto",
) -> str:
    """A SuperNode's `--node-config`: which client it is, its own data, its state folder and
    the device it trains on (`fedfields.flower.node.node_device`)."""
    entries = [f"partition-id={partition_id}", f"num-partitions={num_partitions}"]
    if data_dir is not None:
        entries.append(f"data-dir={json.dumps(str(data_dir.resolve()))}")
    entries.append(f"state-dir={json.dumps(str(state_dir.resolve()))}")
    entries.append(f"device={json.dumps(device)}")
    return " ".join(entries)


def federation_toml(address: str, root_certificates: Path) -> str:
    """The CLI's config.toml: one default SuperLink connection over TLS trusting our CA."""
    return (
        "[superlink]\n"
        f'default = "{FEDERATION}"\n\n'
        f"[superlink.{FEDERATION}]\n"
        f"address = {json.dumps(address)}\n"
        f"root-certificates = {json.dumps(str(root_certificates.resolve()))}\n"
    )


class Deployment:
    """One SuperLink and its SuperNodes on 127.0.0.1 over TLS, owned and stopped as a whole.

    Use as a context manager: leaving it stops every process it started (with its process
    tree) and any stray process still running with a FLWR_HOME inside `directory`.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self.logs = self.directory / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.tls: TlsFiles = write_tls_files(self.directory / "tls")
        self.port = free_ports(1)[0]
        self.address = f"{LOCAL_HOST}:{self.port}"
        self.cli_home = self.directory / "cli"
        self.cli_home.mkdir(exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            federation_toml(self.address, self.tls.ca_certificate)
        )
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.flwr = str(Path(sys.executable).with_name("flwr"))

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def environment(self, home: Path) -> dict[str, str]:
        """The environment of a Flower process whose home is `home` (venv scripts first)."""
        home.mkdir(parents=True, exist_ok=True)
        scripts = str(Path(sys.executable).parent)
        return {
            **os.environ,
            **ENVIRONMENT,
            "FLWR_HOME": str(home),
            "PATH": f"{scripts}:{os.environ.get('PATH', '')}",
        }

    def _start(
        self, name: str, command: list[str], home: Path, pipe: bool = False
    ) -> subprocess.Popen[str]:
        """Start `command` in its own session, its output to logs/<name>.log (or a pipe)."""
        if name in self.processes:
            raise ValueError(f"deployment {self.directory}: process {name!r} already started")
        with (self.logs / f"{name}.log").open("w") as log:
            process = subprocess.Popen(
                command,
                cwd=self.directory,
                env=self.environment(home),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipe else log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops it
            )
        self.processes[name] = process
        return process

    def start_superlink(self, timeout: float = 60.0) -> None:
        """Start the SuperLink (TLS, no runtime dependency installation); wait for its port."""
        command = [str(Path(sys.executable).with_name("flower-superlink"))]
        command += ["--host", LOCAL_HOST, "--port", str(self.port)]
        command += ["--ssl-ca-certfile", str(self.tls.ca_certificate)]
        command += ["--ssl-certfile", str(self.tls.server_certificate)]
        command += ["--ssl-keyfile", str(self.tls.server_key)]
        command += ["--disable-runtime-dependency-installation"]
        process = self._start("superlink", command, self.directory / "superlink")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"flower-superlink exited with {process.returncode}; "
                    f"see {self.logs / 'superlink.log'}"
                )
            try:
                socket.create_connection((LOCAL_HOST, self.port), timeout=1.0).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"flower-superlink did not listen on {self.address} in {timeout:g} s")

    def start_supernode(
        self, partition_id: int, num_partitions: int, data_dir: Path | None, device: str = "auto"
    ) -> str:
        """Start SuperNode `partition_id` holding `data_dir`, training on `device`; returns its
        name (node_NN).

        Its state folder (`state-dir`) and FLWR_HOME live under nodes/node_NN; its ClientApp
        runtime API gets its own free port.
        """
        name = f"node_{partition_id:02d}"
        node_dir = self.directory / "nodes" / name
        state_dir = node_dir / "state"
        config = node_config_text(partition_id, num_partitions, data_dir, state_dir, device)
        command = [str(Path(sys.executable).with_name("flower-supernode"))]
        command += ["--superlink", self.address]
        command += ["--root-certificates", str(self.tls.ca_certificate)]
        command += ["--host", LOCAL_HOST, "--port", str(free_ports(1)[0])]
        command += ["--node-config", config]
        self._start(name, command, node_dir / "flwr-home")
        return name

    def online_nodes(self) -> int:
        """How many SuperNodes the SuperLink reports online (`flwr supernode ls`)."""
        listing = subprocess.run(
            [self.flwr, "supernode", "ls", FEDERATION, "--format", "json"],
            cwd=self.directory,
            env=self.environment(self.cli_home),
            capture_output=True,
            text=True,
        )
        return len(re.findall(r'"status":\s*"online"', listing.stdout))

    def wait_for_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Wait until `count` SuperNodes are online; fail naming a SuperNode that exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {process.returncode}; see {self.logs / name}.log"
                    )
            if self.online_nodes() >= count:
                return
            time.sleep(1.0)
        raise TimeoutError(f"fewer than {count} SuperNodes came online in {timeout:g} s")

    def run(
        self,
        app_dir: Path,
        run_config: str,
        timeout: float,
        on_line: Callable[[str], None] = lambda line: None,
    ) -> RunOutcome:
        """`flwr run <app_dir> <federation> --stream`: each output line goes to
        logs/flwr-run.log and to `on_line`; returns the SuperLink's final status of the run.

        Past `timeout` seconds the run is stopped (`flwr stop`) and its status is 'timed-out'.
        """
        command = [self.flwr, "run", str(app_dir), FEDERATION, "--stream"]
        if run_config:
            command += ["--run-config", run_config]
        on_line("$ " + " ".join(shlex.quote(part) for part in command) + "\n")
        process = self._start("flwr-run", command, self.cli_home, pipe=True)
        assert process.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_stream, args=(process.stdout, lines), daemon=True).start()
        output, deadline, timed_out = [], time.monotonic() + timeout, False
        with (self.logs / "flwr-run.log").open("w") as log:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                try:
                    line = lines.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    continue
                if line is None:
                    break
                log.write(line)
                log.flush()
                output.append(line)
                on_line(line)
        text = "".join(output)
        run_id = run_id_of(text)
        env = self.environment(self.cli_home)
        if timed_out:
            if run_id is not None:
                subprocess.run(
                    [self.flwr, "stop", str(run_id), FEDERATION], env=env, capture_output=True
                )
            stop_pids(process_tree(process.pid))
            return RunOutcome(run_id, "timed-out", text)
        process.wait()
        if run_id is None:
            return RunOutcome(None, "not-started", text)
        return RunOutcome(run_id, run_status(self.flwr, run_id, env), text)

    def stop(self) -> None:
        """Stop every process started here (whole trees, newest first), then any stray one
        still running with a FLWR_HOME under the deployment directory. SIGINT and SIGTERM
        wait until this is done, so a Ctrl-C cannot cut the clean-up short."""
        stopping = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
        try:
            for name in reversed(list(self.processes)):
                process = self.processes[name]
                if process.poll() is None:
                    stop_pids(process_tree(process.pid))
                process.wait()
            stop_pids(processes_with_home_under(self.directory))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stream(pipe: IO[str], lines: queue.Queue[str | None]) -> None:
    """Copy `pipe`'s lines into `lines`, then None."""
    for line in pipe:
        lines.put(line)
    lines.put(None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.deploy",
        description=(
            "Deploy a fedfields job on real Flower processes on 127.0.0.1 with TLS: one "
            "SuperLink, one SuperNode per user holding only its own data."
        ),
    )
    parser.add_argument("--users", type=int, default=4, help="SuperNodes, one per user")
    parser.add_argument(
        "--run-config",
        default="",
        help='the ServerApp\'s run-config overrides, e.g. "num-server-rounds=2 local-steps=8"',
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="default runs/<time>-<job>")
    parser.add_argument(
        "--deploy-dir",
        type=Path,
        default=None,
        help="certificates, Flower homes, node state (kept when reused) and logs; "
        "default runs/<time>-deploy",
    )
    parser.add_argument("--crowd", type=Path, default=None, help="crowd dataset (built if missing)")
    parser.add_argument("--scene", type=Path, default=APP_DIR / "data" / "lego")
    parser.add_argument("--views-per-user", type=int, default=5)
    parser.add_argument("--downscale", type=float, default=2.0, help="of the scene's images")
    parser.add_argument(
        "--objects", type=Path, default=None, help="object collection (built if missing)"
    )
    parser.add_argument("--object-views", type=int, default=16, help="views per object")
    parser.add_argument("--object-resolution", type=int, default=32, help="object image size")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the run")
    parser.add_argument(
        "--device",
        default="auto",
        help=f"each SuperNode's node-config device: {DEVICE_CHOICES} (auto: CUDA when visible)",
    )
    args = parser.parse_args(argv)
    try:  # the nodes run on this machine: a device they cannot see fails here, not per round
        parse_device(args.device, "--device")
    except ValueError as error:
        parser.error(str(error))
    return args


@dataclass(frozen=True)
class Plan:
    """What to deploy: the nodes and their folders, the ServerApp's run-config without its
    run directory, and that directory if the user named it in run-config."""

    nodes: NodePlan
    run_config: str
    run_dir: Path | None


def plan(args: argparse.Namespace, env: dict[str, str]) -> Plan:
    """Each node's data (building the crowd or object collection when missing) and the
    ServerApp's run-config: the user's overrides, no data or state directory."""
    overrides = parse_config_args([args.run_config]) if args.run_config.strip() else {}
    for key in NODE_KEYS:
        if key in overrides:
            raise ValueError(
                f"--run-config {key}={overrides[key]!r}: a deployed server names no node's "
                f"files; each SuperNode gets its {key} by --node-config (use --crowd or "
                "--objects for the data)"
            )
    if overrides.get("simulation-audit", False):
        raise ValueError(
            "--run-config simulation-audit=true: the audit reads every user's ground truth, "
            "which a deployed server does not have (simulation only)"
        )
    if args.users < 1:
        raise ValueError(f"--users {args.users}: a deployment needs at least one SuperNode")
    run_dir = str(overrides.pop("run-dir", ""))
    config = job_config(args.run_config)
    if config.common.mode == "federated" and config.common.task in META_TASKS:
        given = overrides.setdefault("num-clients", args.users)
        if given != args.users:
            raise ValueError(f"--run-config num-clients={given} differs from --users {args.users}")
        if "clients-per-round" not in overrides:
            overrides["clients-per-round"] = min(config.meta.clients_per_round, args.users)
        config = job_config(as_run_config(overrides))
    nodes = plan_nodes(config, DataOptions.from_args(args), env, users=args.users)
    config.check_node_count(nodes.count, f"--users {args.users}")
    if nodes.eval_scene_dir is not None:  # the server's public held-out objects
        overrides.setdefault("eval-scene-dir", str(nodes.eval_scene_dir))
    overrides.setdefault("min-available-nodes", nodes.count)  # round 1 waits for all nodes
    return Plan(nodes, as_run_config(overrides), Path(run_dir) if run_dir else None)


class Interrupted(Exception):
    """A signal (SIGINT, SIGTERM) asked the launcher to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, _: FrameType | None) -> None:
    """Stop on the first SIGINT/SIGTERM; ignore further ones so the clean-up finishes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def deploy(
    job: Plan, deploy_dir: Path, run_config: str, timeout: float, device: str = "auto"
) -> RunOutcome:
    """Start the federation, run the job on it, stop everything; returns the run's outcome."""
    with Deployment(deploy_dir) as deployment:
        print(
            f"fedfields deploy: SuperLink on {deployment.address} (TLS), logs in {deployment.logs}",
            flush=True,
        )
        deployment.start_superlink()
        for index, data_dir in enumerate(job.nodes.folders):
            deployment.start_supernode(index, job.nodes.count, data_dir, device)
        deployment.wait_for_nodes(job.nodes.count)
        print(f"fedfields deploy: {job.nodes.count} SuperNodes online", flush=True)
        app = staged_app(APP_DIR, deploy_dir / "app")  # Flower's FAB without its .venv walk
        return deployment.run(
            app, run_config, timeout, lambda line: print(line, end="", flush=True)
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    deploy_dir = (args.deploy_dir or APP_DIR / "runs" / f"{stamp}-deploy").resolve()
    try:
        job = plan(args, {**os.environ, **ENVIRONMENT})
    except ValueError as error:
        print(f"fedfields deploy: {error}", file=sys.stderr)
        return 2
    default_run_dir = APP_DIR / "runs" / f"{stamp}-{job.nodes.name}"
    run_dir = (args.run_dir or job.run_dir or default_run_dir).resolve()
    run_config = f"run-dir={json.dumps(str(run_dir))} {job.run_config}".strip()
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    try:
        outcome = deploy(job, deploy_dir, run_config, args.timeout, args.device)
    except Interrupted as stop:
        print(
            f"fedfields deploy: {stop}: stopped all it started; logs in {deploy_dir}/logs",
            file=sys.stderr,
        )
        return 128 + stop.signum
    except (RuntimeError, TimeoutError) as error:
        print(f"fedfields deploy: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    if outcome.run_id is None:
        print(
            f"fedfields deploy: no run started ({outcome.status}); logs in {deploy_dir}/logs",
            file=sys.stderr,
        )
        return 1
    if outcome.status != "finished:completed":
        print(failure_line(outcome.run_id, outcome.status, outcome.output), file=sys.stderr)
        return 1
    print(
        f"fedfields deploy: run {outcome.run_id} completed in {seconds:.0f} s; report in {run_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
