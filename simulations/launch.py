"""`python -m simulations.launch`: a federated run, by `flwr run .` through Ray.

It does what a careful user of Flower 1.41 does by hand (see README): keeps Flower's home
and state inside the project, forbids run-time dependency installation (which would pull a
CUDA torch), builds the run-config `task`'s dataset once (the crowdsourced scene, or the
object collection for FedMeNF's objects; faces and video come with scikit-image) and passes
absolute paths (app bundles carry no images), starts one virtual SuperNode per user or
client, streams the logs, then asks the SuperLink whether the run completed, since
`flwr run` exits 0 even when the ServerApp fails, and stops the SuperLink it started.
As the experimenter it attaches the simulation-only observers (`simulation-audit`), which
read the data root's ground truth, and gives virtual node i its private state directory
`<run-dir>.nodes/node_NN` (`state-dir`), outside the server's run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

from flwr.common.config import parse_config_args

from fedfields.config import FederatedConfig, MetaSettings, meta_settings
from simulations import APP_DIR
from strategies import strategy_class

SUPERLINK_PORT = 39191  # not Flower's default 39091, so other projects' SuperLinks are left alone
LAUNCHER_KEYS = ("run-dir", "data-dir", "state-dir", "simulation-audit", "min-available-nodes")
ENVIRONMENT = {
    "FLWR_HOME": str(APP_DIR / ".flwr-home"),
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(SUPERLINK_PORT),
    "FLWR_LOCAL_CONTROL_API_PORT": str(SUPERLINK_PORT + 2),
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",  # silences Ray's GPU-masking notice; no GPUs
}


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
        "--client-gpus", type=float, default=0.0, help="GPUs per virtual client, e.g. 0.25"
    )
    parser.add_argument(
        "--no-audit",
        action="store_true",
        help="attach no simulation observer (large runs: the audit loads every user's photos)",
    )
    args = parser.parse_args(argv)
    if args.client_cpus < 1:
        parser.error(f"--client-cpus must be a positive integer, got {args.client_cpus}")
    if args.client_gpus < 0:
        parser.error(f"--client-gpus must be >= 0, got {args.client_gpus}")
    return args


def crowd_dataset(args: argparse.Namespace, env: dict[str, str]) -> Path:
    """The crowd folder (the Novel Blender layout), built by `fedfields data crowd` on first use;
    a given folder of user_* folders (e.g. links sharing users' photos) is used as it is."""
    crowd = args.crowd or APP_DIR / "runs" / (
        f"crowd_{args.scene.name}_nb_{args.users}x{args.views_per_user}_ds{args.downscale:g}"
    )
    if not (crowd / "crowd.json").is_file() and not any(crowd.glob("user_*")):
        command = [sys.executable, "-m", "fedfields.cli", "data", "crowd"]
        command += ["--scene", str(args.scene), "--users", str(args.users)]
        command += ["--views-per-user", str(args.views_per_user)]
        command += ["--downscale", str(args.downscale), "--out", str(crowd)]
        subprocess.run(command, check=True, env=env)
    return crowd.resolve()


def replicated_crowd(crowd: Path, clients: int) -> Path:
    """`<crowd>.x<clients>/user_NNN`: links giving client i the photos of user i mod U, so
    many clients (each with its own private state) can share a crowd's U users' views."""
    users = sorted(path for path in crowd.glob("user_*") if path.is_dir())
    if not users:
        raise FileNotFoundError(f"{crowd}: no user_* folders to share among {clients} clients")
    if clients > 1000:
        raise ValueError(f"at most 1000 clients share a crowd (user_000..user_999), got {clients}")
    out = crowd.with_name(f"{crowd.name}.x{clients}")
    out.mkdir(exist_ok=True)
    for index in range(clients):
        link = out / f"user_{index:03d}"
        if not link.exists():
            link.symlink_to(users[index % len(users)].resolve())
    return out


def object_collection(
    args: argparse.Namespace, settings: MetaSettings, env: dict[str, str]
) -> Path:
    """The N clients' and the held-out objects, built by `fedfields data objects` on first use."""
    count = settings.num_clients + settings.heldout_tasks
    objects = args.objects or APP_DIR / "runs" / (
        f"objects_{count}x{args.object_views}_r{args.object_resolution}"
    )
    if not (objects / "collection.json").is_file():
        command = [sys.executable, "-m", "fedfields.cli", "data", "objects", "--count", str(count)]
        command += ["--views", str(args.object_views)]
        command += ["--resolution", str(args.object_resolution), "--out", str(objects)]
        subprocess.run(command, check=True, env=env)
    return objects.resolve()


def heldout_objects(collection: Path, settings: MetaSettings) -> Path:
    """A folder linking only the objects after the N clients': the server's public
    `eval-scene-dir` (it must never be given the clients' collection)."""
    heldout = collection.with_name(collection.name + ".heldout")
    heldout.mkdir(exist_ok=True)
    objects = sorted(collection.glob("object_*"))
    for folder in objects[settings.num_clients : settings.num_clients + settings.heldout_tasks]:
        link = heldout / folder.name
        if not link.exists():
            link.symlink_to(folder)
    return heldout


def job_config(run_config: str) -> FederatedConfig:
    """The job's settings: pyproject's run-config with the user's overrides."""
    with (APP_DIR / "pyproject.toml").open("rb") as file:
        declared = tomllib.load(file)["tool"]["flwr"]["app"]["config"]
    config = FederatedConfig.from_run_config({**declared, **parse_config_args([run_config])})
    strategy_class(config.strategy_name)  # an unknown strategy stops here, naming the known
    return config


def resumed_run_config(run_dir: Path, extra: str) -> str:
    """The run-config of the run in `run_dir` (its config.json) with resume=true, then `extra`."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"--resume {run_dir}: no config.json there (not a fedfields run)")
    saved = {**json.loads(path.read_text()), "resume": True}
    return " ".join(f"{key}={json.dumps(value)}" for key, value in saved.items()) + f" {extra}"


def user_overrides(run_config: str) -> str:
    """The user's run-config without the keys the launcher resolves (`LAUNCHER_KEYS`)."""
    overrides = parse_config_args([run_config]) if run_config.strip() else {}
    return " ".join(
        f"{key}={json.dumps(value)}" for key, value in overrides.items() if key not in LAUNCHER_KEYS
    )


def our_superlinks(flwr_home: str = ENVIRONMENT["FLWR_HOME"]) -> list[int]:
    """PIDs of `flower-superlink` processes running with `flwr_home` (this project's)."""
    marker = f"FLWR_HOME={flwr_home}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes()
            environment = (proc / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if b"flower-superlink" in command and marker in environment.split(b"\0"):
            found.append(int(proc.name))
    return found


def stop_tree(pid: int) -> None:
    """SIGTERM `pid` and every process below it (SuperExec, simulation runtime, Ray)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(proc.name))
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        tree.append(current)
        frontier.extend(children.get(current, []))
    for member in reversed(tree):
        try:
            os.kill(member, signal.SIGTERM)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # flwr starts `flower-superlink` by name: the venv's scripts must come first on PATH.
    scripts = str(Path(sys.executable).parent)
    env = {**os.environ, **ENVIRONMENT, "PATH": f"{scripts}:{os.environ.get('PATH', '')}"}
    Path(env["FLWR_HOME"]).mkdir(exist_ok=True)
    try:
        if args.resume is not None:
            args.run_config = resumed_run_config(args.resume.resolve(), args.run_config)
        config = job_config(args.run_config)
        settings = meta_settings(config) if config.common.task != "scene" else None
    except ValueError as error:
        print(f"fedfields: {error}", file=sys.stderr)
        return 2
    name = config.strategy_name
    given = Path(config.deployment.data_dir).resolve() if config.deployment.data_dir else None
    if config.common.mode == "split":  # one client holding the scene's images
        data_dir, num_nodes, name = given or args.scene.resolve(), 1, "split"
    elif settings is None:
        data_dir = given or crowd_dataset(args, env)
        if args.clients is not None:
            data_dir = replicated_crowd(data_dir, args.clients)
            args.no_audit = True  # the audit's ground truth is per user, not per shared client
            print(f"fedfields: {args.clients} clients share the photos in {data_dir} (no audit)")
        num_nodes = len(list(data_dir.glob("user_*")))
    else:
        data_dir = None
        if config.common.task == "objects":
            data_dir = given or object_collection(args, settings, env)
        num_nodes = settings.num_clients
        name = f"{config.common.task}-{name}-{config.meta.meta_learner}"
    try:  # e.g. min-train-nodes above the nodes started, before anything runs
        config.check_node_count(num_nodes, "num-supernodes")
    except ValueError as error:
        print(f"fedfields: {error}", file=sys.stderr)
        return 2
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = (
        args.run_dir or Path(config.common.run_dir or APP_DIR / "runs" / f"{stamp}-{name}")
    ).resolve()
    state_dir = run_dir.with_name(run_dir.name + ".nodes")
    run_config = f"run-dir={json.dumps(str(run_dir))} state-dir={json.dumps(str(state_dir))}"
    audit = "false" if args.no_audit else "true"
    run_config += f" simulation-audit={audit} min-available-nodes={num_nodes}"
    if data_dir is not None:
        run_config = f"data-dir={json.dumps(str(data_dir))} {run_config}"
    if (
        config.common.task == "objects"
        and settings is not None
        and not config.common.eval_scene_dir
    ):
        heldout = heldout_objects(data_dir, settings)
        run_config += f" eval-scene-dir={json.dumps(str(heldout))}"
    if config.common.mode == "split" and "downscale" not in parse_config_args([args.run_config]):
        run_config += f" downscale={float(args.downscale)}"  # the raw scene, like the crowd's
    federation = federation_config(num_nodes, args.client_cpus, args.client_gpus)
    flwr = str(Path(sys.executable).with_name("flwr"))
    already_running = set(our_superlinks())
    env.pop("RAY_ADDRESS", None)
    if args.ray_address:
        if already_running:  # it would keep the Ray settings it started with (pitfall P3)
            print(
                f"fedfields: this project's SuperLink is already running (PIDs "
                f"{sorted(already_running)}) with its own Ray settings; stop it to run on "
                f"the Ray cluster at {args.ray_address}",
                file=sys.stderr,
            )
            return 2
        env["RAY_ADDRESS"] = args.ray_address  # read by the SuperLink's simulation runtime
    command = [flwr, "run", str(APP_DIR), "--stream", "--federation-config", federation]
    command += ["--run-config", f"{run_config} {user_overrides(args.run_config)}".strip()]
    print("$", " ".join(shlex.quote(part) for part in command), flush=True)
    try:
        output = _run_streaming(command, env)
        run_id = re.search(r"run (\d+)", output)
        if run_id is None:
            print("fedfields: flwr run did not start a run", file=sys.stderr)
            return 1
        status = _run_status(flwr, run_id[1], env)
    finally:  # Flower leaves the SuperLink it started running (pitfall P3): stop ours
        for pid in set(our_superlinks()) - already_running:
            stop_tree(pid)
    if status != "finished:completed":
        print(f"fedfields: run {run_id[1]} ended as {status!r}; see the log above", file=sys.stderr)
        return 1
    print(f"fedfields: report in {run_dir}")
    return 0


def federation_config(num_nodes: int, client_cpus: int, client_gpus: float) -> str:
    """Flower's simulation settings: one virtual SuperNode per client and each client's Ray
    resources (CPUs must be whole: Flower 1.41's `flwr run` takes no fractional CPUs)."""
    config = f"num-supernodes={num_nodes} client-resources-num-cpus={client_cpus}"
    return config + f" client-resources-num-gpus={client_gpus:g}"


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


def _run_status(flwr: str, run_id: str, env: dict[str, str]) -> str:
    """The SuperLink's final status of the run, e.g. 'finished:completed'."""
    for _ in range(30):
        listing = subprocess.run(
            [flwr, "ls", "--run-id", run_id, "--format", "json"],
            cwd=APP_DIR,
            env=env,
            capture_output=True,
            text=True,
        )
        match = re.search(r'"status":\s*"([^"]+)"', listing.stdout)
        if match and match[1].startswith("finished"):
            return match[1]
        time.sleep(1.0)
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
