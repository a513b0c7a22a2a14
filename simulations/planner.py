"""What both launchers plan and control: which node gets which folder, the datasets behind
them, a simulation launch's own Flower home and SuperLink ports, the SuperLink's record of a
run, the ServerApp's error, and stopping exactly the processes a launcher started.

`python -m simulations.launch` (virtual SuperNodes through Ray) and `python -m
simulations.deploy` (real SuperNodes over TLS) are thin command lines over this module: the
crowd's `user_NN` folders, FedMeNF's `object_NNN` folders and split mode's one scene are
assigned to nodes here, once, and every process tree either launcher stops is walked here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns
from flwr.common.config import parse_config_args
from flwr.supercore.constant import APP_PUBLISH_EXCLUDE_PATTERNS

from fedfields.config import FederatedConfig, MetaSettings, meta_settings
from simulations import APP_DIR
from strategies import parse_app_config, strategy_class

ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",  # silences Ray's GPU-masking notice; no GPUs
}
"""Flower's settings for every process a launcher starts: no telemetry, no run-time
dependency installation (a SuperLink would pull a CUDA torch). Flower's home and the local
SuperLink's ports are each launch's own (`LocalSuperLink`)."""
FLOWER_HOMES = APP_DIR / ".flwr-home"
"""Where `simulations.launch` keeps each launch's Flower home (git-ignored)."""
LOOPBACK = "127.0.0.1"
STOP_GRACE_SECONDS = 10.0
MAX_SHARED_CLIENTS = 1000  # user_000..user_999
ERROR_LINE = re.compile(r"^\s*(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception)): (\S.*?)\s*$")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class DataOptions:
    """The launchers' dataset flags: the crowd or object collection to use or build."""

    scene: Path = APP_DIR / "data" / "lego"
    users: int = 16
    views_per_user: int = 5
    downscale: float = 2.0
    crowd: Path | None = None
    objects: Path | None = None
    object_views: int = 16
    object_resolution: int = 32

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataOptions:
        """The options a launcher's parsed flags name."""
        return cls(
            scene=args.scene,
            users=args.users,
            views_per_user=args.views_per_user,
            downscale=args.downscale,
            crowd=args.crowd,
            objects=args.objects,
            object_views=args.object_views,
            object_resolution=args.object_resolution,
        )


@dataclass(frozen=True)
class NodePlan:
    """Which node gets which folder: node i holds `folders[i]` (None: its data comes with
    the code, e.g. faces by partition id); `data_root` is the folder holding them (a
    simulation's `data-dir`), `eval_scene_dir` the server's held-out objects, `name` the job's
    name in its default run directory."""

    name: str
    folders: tuple[Path | None, ...]
    data_root: Path | None = None
    eval_scene_dir: Path | None = None

    @property
    def count(self) -> int:
        """How many nodes the job runs on."""
        return len(self.folders)


def job_config(run_config: str) -> FederatedConfig:
    """The job's settings: pyproject's run-config with the user's overrides."""
    with (APP_DIR / "pyproject.toml").open("rb") as file:
        declared = tomllib.load(file)["tool"]["flwr"]["app"]["config"]
    overrides = parse_config_args([run_config]) if run_config.strip() else {}
    config = parse_app_config({**declared, **overrides})
    strategy_class(config.strategy_name)  # an unknown strategy stops here, naming the known
    return config


def as_run_config(values: dict[str, object]) -> str:
    """`key=value ...` with TOML-typed values (strings quoted), as `--run-config` reads it."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


def job_name(config: FederatedConfig) -> str:
    """The job's name: split, the scene's strategy, or <task>-<strategy>-<meta-learner>."""
    if config.common.mode == "split":
        return "split"
    if config.common.task == "scene":
        return config.strategy_name
    return f"{config.common.task}-{config.strategy_name}-{config.meta.meta_learner}"


def plan_nodes(
    config: FederatedConfig,
    data: DataOptions,
    env: dict[str, str],
    clients: int | None = None,
    users: int | None = None,
) -> NodePlan:
    """The nodes of `config`'s job and their folders, building the dataset when missing.

    split: one node holding the scene (or `data-dir`); scene: one node per `user_*` folder
    of the crowd (`data-dir`, `--crowd` or built), the first `users` of them when given, or
    `clients` nodes sharing the users' photos through links; meta tasks: `num-clients`
    nodes, each holding an `object_*` folder for task objects (the server scoring the
    held-out objects after them). ValueError when the crowd has fewer than `users` users.
    """
    given = Path(config.deployment.data_dir).resolve() if config.deployment.data_dir else None
    name = job_name(config)
    if config.common.mode == "split":
        scene = given or data.scene.resolve()
        return NodePlan(name, (scene,), data_root=scene)
    if config.common.task == "scene":
        crowd = given or crowd_dataset(data, env)
        if clients is not None:
            crowd = replicated_crowd(crowd, clients)
        folders = sorted(path for path in crowd.glob("user_*") if path.is_dir())
        if users is not None:
            if len(folders) < users:
                raise ValueError(
                    f"crowd {crowd} has {len(folders)} user folders, not --users {users}"
                )
            folders = folders[:users]
        return NodePlan(name, tuple(folders), data_root=crowd)
    settings = meta_settings(config)
    if config.common.task != "objects":  # faces, photos, video: images by partition id
        return NodePlan(name, (None,) * settings.num_clients)
    collection = given or object_collection(data, settings, env)
    objects = sorted(collection.glob("object_*"))[: settings.num_clients]
    if len(objects) < settings.num_clients:
        raise ValueError(
            f"object collection {collection} has {len(objects)} object folders, not the "
            f"{settings.num_clients} clients of 'num-clients'"
        )
    heldout = config.common.eval_scene_dir or heldout_objects(collection, settings)
    return NodePlan(name, tuple(objects), data_root=collection, eval_scene_dir=Path(heldout))


def crowd_dataset(data: DataOptions, env: dict[str, str]) -> Path:
    """The crowd folder (the Novel Blender layout), built by `fedfields data crowd` on first use;
    a given folder of user_* folders (e.g. links sharing users' photos) is used as it is."""
    crowd = data.crowd or APP_DIR / "runs" / (
        f"crowd_{data.scene.name}_nb_{data.users}x{data.views_per_user}_ds{data.downscale:g}"
    )
    if not (crowd / "crowd.json").is_file() and not any(crowd.glob("user_*")):
        command = [sys.executable, "-m", "fedfields.cli", "data", "crowd"]
        command += ["--scene", str(data.scene), "--users", str(data.users)]
        command += ["--views-per-user", str(data.views_per_user)]
        command += ["--downscale", str(data.downscale), "--out", str(crowd)]
        subprocess.run(command, check=True, env=env)
    return crowd.resolve()


def replicated_crowd(crowd: Path, clients: int) -> Path:
    """`<crowd>.x<clients>/user_NNN`: links giving client i the photos of user i mod U, so
    many clients (each with its own private state) can share a crowd's U users' views."""
    users = sorted(path for path in crowd.glob("user_*") if path.is_dir())
    if not users:
        raise FileNotFoundError(f"{crowd}: no user_* folders to share among {clients} clients")
    if not 1 <= clients <= MAX_SHARED_CLIENTS:
        raise ValueError(
            f"1 to {MAX_SHARED_CLIENTS} clients share a crowd (user_000..user_999), got {clients}"
        )
    out = crowd.with_name(f"{crowd.name}.x{clients}")
    out.mkdir(exist_ok=True)
    for index in range(clients):
        link = out / f"user_{index:03d}"
        if not link.exists():
            link.symlink_to(users[index % len(users)].resolve())
    return out


def object_collection(data: DataOptions, settings: MetaSettings, env: dict[str, str]) -> Path:
    """The N clients' and the held-out objects, built by `fedfields data objects` on first use."""
    count = settings.num_clients + settings.heldout_tasks
    objects = data.objects or APP_DIR / "runs" / (
        f"objects_{count}x{data.object_views}_r{data.object_resolution}"
    )
    if not (objects / "collection.json").is_file():
        command = [sys.executable, "-m", "fedfields.cli", "data", "objects", "--count", str(count)]
        command += ["--views", str(data.object_views)]
        command += ["--resolution", str(data.object_resolution), "--out", str(objects)]
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


def run_status(flwr: str, run_id: int, env: dict[str, str], attempts: int = 30) -> str:
    """The SuperLink's final status of the run (`flwr ls --run-id`), e.g. 'finished:completed';
    'unknown' when it reports no finished status within `attempts` seconds."""
    for _ in range(attempts):
        listing = subprocess.run(
            [flwr, "ls", "--run-id", str(run_id), "--format", "json"],
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


def run_id_of(output: str) -> int | None:
    """The run id `flwr run` printed when it started the run, or None."""
    found = re.search(r"run (\d+)", output)
    return int(found[1]) if found else None


def server_error(output: str) -> str | None:
    """The last `SomethingError: message` line of a run's output (the ServerApp's exception,
    as the traceback's last line names it), as `SomethingError: message`; None when none."""
    found = None
    for line in ANSI_ESCAPE.sub("", output).splitlines():
        match = ERROR_LINE.match(line)
        if match:
            found = f"{match[1]}: {match[2]}"
    return found


def failure_line(run_id: int, status: str, output: str) -> str:
    """One line saying why run `run_id` did not complete: the ServerApp's error when the
    output names one, else the SuperLink's status."""
    error = server_error(output)
    if error is not None:
        return f"fedfields: run {run_id} failed: {error}"
    return f"fedfields: run {run_id} failed: it ended as {status!r}; see the log above"


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first (read from /proc)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(proc.name))
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop(0)
        tree.append(current)
        frontier.extend(children.get(current, []))
    return tree


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def signal_pids(pids: list[int], signum: int) -> None:
    """Send `signum` to each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def stop_pids(pids: list[int], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM `pids` (children first), SIGKILL those still running after `grace` seconds."""
    signal_pids(list(reversed(pids)), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    signal_pids([pid for pid in pids if alive(pid)], signal.SIGKILL)


def stop_tree(pid: int, grace: float = STOP_GRACE_SECONDS) -> None:
    """Stop `pid` and every process below it (SuperExec, simulation runtime, Ray)."""
    stop_pids(process_tree(pid), grace)


def _environment_of(pid: int) -> list[bytes]:
    """The `KEY=value` entries of process `pid`'s environment ([] when gone or not ours)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _pids() -> list[int]:
    """Every process id in /proc but this process's own."""
    own = os.getpid()
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != own]


def processes_with_home_under(directory: Path) -> list[int]:
    """PIDs of this user's running processes whose FLWR_HOME lies inside `directory`."""
    home = f"FLWR_HOME={directory.resolve()}".encode()
    return [
        pid
        for pid in _pids()
        if any(entry == home or entry.startswith(home + b"/") for entry in _environment_of(pid))
        and alive(pid)
    ]


def superlinks_with_home(flwr_home: str | Path) -> list[int]:
    """PIDs of `flower-superlink` processes running with FLWR_HOME `flwr_home`."""
    marker = f"FLWR_HOME={flwr_home}".encode()
    found = []
    for pid in _pids():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if b"flower-superlink" in command and marker in _environment_of(pid):
            found.append(pid)
    return found


@dataclass(frozen=True)
class LocalSuperLink:
    """One launch's own Flower home and the ports of the local SuperLink `flwr run` starts
    for it (address `:local:`): `http_port` serves all its APIs in Flower 1.41 (Control,
    Fleet, and the runtime API the SuperExec and simulation dial, formerly ServerAppIo);
    `control_port` is the deprecated gRPC Control API's, bound only under
    FLWR_INTERNAL_GRPC_CONTROL_API=1, yet chosen free like the other."""

    home: Path
    http_port: int
    control_port: int

    def environment(self) -> dict[str, str]:
        """The variables that point `flwr` and the SuperLink it starts at them."""
        return {
            "FLWR_HOME": str(self.home),
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(self.http_port),
            "FLWR_LOCAL_CONTROL_API_PORT": str(self.control_port),
        }


def staged_app(app_dir: Path, stage: Path) -> Path:
    """`stage`, created holding a copy of exactly the files `flwr run app_dir` packages.

    Flower 1.41 lists every file under the app before it filters (`collect_files`): with a
    virtual environment inside that is about 50,000 files, 4 s a launch. This walk skips the
    directories .gitignore or Flower's publish rules exclude whole, then keeps what Flower's
    own filter keeps, so the FAB Flower builds from `stage` is the one it builds from
    `app_dir`, byte for byte. A .gitignore that re-includes ('!') prunes nothing.
    """
    patterns = load_gitignore_patterns(app_dir / ".gitignore")
    skipped = build_pathspec(
        [*APP_PUBLISH_EXCLUDE_PATTERNS]
        + ([] if any(p.lstrip().startswith("!") for p in patterns) else patterns)
    )
    files: dict[str, Path | bytes] = {}
    for directory, subdirectories, names in os.walk(app_dir, followlinks=False):
        relative = Path(directory).relative_to(app_dir)
        subdirectories[:] = [
            name
            for name in subdirectories
            if not skipped.match_file(f"{(relative / name).as_posix()}/")
        ]
        for name in names:
            path = Path(directory) / name
            if not path.is_symlink():
                files[(relative / name).as_posix()] = path
    shutil.rmtree(stage, ignore_errors=True)
    for relative_path, source in filter_paths_for_publish(files).items():
        target = stage / relative_path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)  # type: ignore[arg-type]
    return stage


def launch_home(run_dir: Path, pid: int | None = None) -> Path:
    """The Flower home of launch `pid` (default: this process) of the run in `run_dir`:
    .flwr-home/<run-dir name>-<pid>, so no two running launches share one."""
    return FLOWER_HOMES / f"{run_dir.name}-{os.getpid() if pid is None else pid}"


def fresh_home(home: Path) -> Path:
    """`home`, created empty (a dead launch's leftover of the same name removed)."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    return home


@contextlib.contextmanager
def reserved_ports(count: int) -> Iterator[tuple[int, ...]]:
    """`count` distinct TCP ports on 127.0.0.1, held until the block ends.

    Each is bound with SO_REUSEADDR and never listened on: the kernel hands a bound port to
    no other bind to port 0 (another launch picking its ports at the same instant) nor to an
    outgoing connection, while the server it is meant for binds and listens on it all the
    same (uvicorn's asyncio server sets SO_REUSEADDR too).
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sockets[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sockets[-1].bind((LOOPBACK, 0))
        yield tuple(sock.getsockname()[1] for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


def stop_launch(home: Path) -> None:
    """Stop what a launch with Flower home `home` left running and nothing else: the
    SuperLinks with that home (whole trees: SuperExec, simulation, Ray), then any process
    still carrying it (every process a launch starts inherits its FLWR_HOME). SIGINT and
    SIGTERM wait until it is done, so a second Ctrl-C cannot cut it short."""
    stopping = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
    try:
        for pid in superlinks_with_home(home):
            stop_tree(pid)
        stop_pids(processes_with_home_under(home))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
