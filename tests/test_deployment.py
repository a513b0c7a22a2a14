"""`python -m simulations.deploy` as a user types it: a subprocess that starts flower-superlink
and flower-supernode processes over TLS on 127.0.0.1, each SuperNode holding one user folder.
The test SIGKILLs one SuperNode by PID during the run; the run completes with the survivors,
counts the failure and leaves no process behind. Also the planner both launchers share:
which node gets which folder, stopping process trees, and the one-line failure message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.cli.flower_config import read_superlink_connection
from flwr.common.config import parse_config_args

from fedfields.config import FederatedConfig
from simulations import APP_DIR, deploy
from simulations.deploy import FEDERATION, federation_toml, node_config_text
from simulations.planner import (
    DataOptions,
    alive,
    failure_line,
    plan_nodes,
    process_tree,
    processes_with_home_under,
    server_error,
    staged_app,
    stop_pids,
    stop_tree,
)
from strategies import parse_app_config

USERS = 3
TINY_RUN_CONFIG = (
    "num-server-rounds=1 local-steps=2 min-train-nodes=2 fraction-train=1.0 "
    "orbit-frames=0 target-samples=512 hash-log2-size=12 hash-levels=4 hash-max-resolution=64 "
    "eval-views-per-round=1"
)
VICTIM = "node_02"


def deploy_command(*flags: str) -> list[str]:
    """`python -m simulations.deploy FLAGS` with this interpreter."""
    return [sys.executable, "-m", "simulations.deploy", *flags]


def supernode_pid(deploy_dir: Path, node: str) -> int | None:
    """The PID of the flower-supernode whose FLWR_HOME lies in <deploy_dir>/nodes/<node>."""
    for pid in processes_with_home_under(deploy_dir / "nodes" / node):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if b"flower-supernode" in command:
            return pid
    return None


@pytest.fixture
def deploy_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path/deploy; afterwards nothing may run with a FLWR_HOME in it (stopped if so)."""
    directory = tmp_path / "deploy"
    yield directory
    left = processes_with_home_under(directory)
    stop_pids(left, grace=2.0)
    assert left == [], f"processes outlived the deployment: {left}"


@pytest.mark.slow  # about 2 minutes: a dead node is declared after 2 missed 30 s heartbeats
def test_deploy_cli_completes_when_a_supernode_is_killed(
    crowd_dir: Path, deploy_dir: Path, tmp_path: Path
) -> None:
    """The CLI as printed in the docs, with the tiny crowd and run-config; node_02 is
    SIGKILLed once round 1 has sampled it, so its reply is a failure the round counts."""
    run_dir = tmp_path / "run"
    command = deploy_command(
        "--users", str(USERS), "--crowd", str(crowd_dir), "--deploy-dir", str(deploy_dir),
        "--run-dir", str(run_dir), "--timeout", "400", "--run-config", TINY_RUN_CONFIG,
    )  # fmt: skip
    cli = subprocess.Popen(
        command, cwd=APP_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, killed = [], None
    try:
        assert cli.stdout is not None
        for line in cli.stdout:
            output.append(line)
            if killed is None and "configure_train: sampled" in line:
                killed = supernode_pid(deploy_dir, VICTIM)
                assert killed is not None, f"no flower-supernode for {VICTIM} under {deploy_dir}"
                os.kill(killed, signal.SIGKILL)
        code = cli.wait(timeout=60)
    finally:
        if cli.poll() is None:  # the test failed: the CLI stops what it started on SIGTERM
            cli.send_signal(signal.SIGTERM)
            cli.wait(timeout=60)
    text = "".join(output)
    assert killed is not None, f"round 1 never sampled:\n{text[-3000:]}"
    assert code == 0, text[-3000:]
    assert not alive(killed)
    for name in ("config.json", "metrics.jsonl", "report.html", "summary.json"):
        assert (run_dir / name).is_file(), f"{name} missing; output:\n{text[-2000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1]
    assert rows[0]["num-failures"] >= 1 and rows[0]["num-replies"] == USERS - 1, rows[0]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data-dir"] == "" and config["state-dir"] == "", "the server named node files"
    for user in range(USERS - 1):  # each survivor's private state, under its own folder
        assert (deploy_dir / "nodes" / f"node_{user:02d}" / "state").is_dir()
    assert "completed" in text.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--run-config", "data-dir='/srv/users'"], "--run-config data-dir='/srv/users'"),
        (["--run-config", "simulation-audit=true"], "simulation-audit=true"),
        (["--users", "0"], "--users 0"),
        (["--run-config", "local-stepz=2"], "did you mean 'local-steps'"),
        (["--run-config", "min-train-nodes=5"], "'min-train-nodes' = 5 is above the 3 nodes"),
    ],
)
def test_deploy_refuses_bad_input_before_starting_anything(
    flags: list[str], message: str, crowd_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Bad flags or run-config: exit 2, one line naming the flag or key, nothing started."""
    deploy_dir = tmp_path / "deploy"
    common = ["--users", str(USERS), "--crowd", str(crowd_dir), "--deploy-dir", str(deploy_dir)]
    assert deploy.main([*common, *flags]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1, error
    assert not deploy_dir.exists()


def test_deploy_cli_exits_2_on_a_server_side_data_dir(crowd_dir: Path, tmp_path: Path) -> None:
    """The same refusal through the command line, as a user meets it."""
    flags = ["--crowd", str(crowd_dir), "--deploy-dir", str(tmp_path / "deploy")]
    result = subprocess.run(
        deploy_command(*flags, "--run-config", "state-dir='/srv/state'"),
        cwd=APP_DIR, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "each SuperNode gets its state-dir" in result.stderr


def test_node_config_names_the_client_and_its_own_folders() -> None:
    text = node_config_text(1, 4, Path("/data/my photos/user_01"), Path("/state/node 1"))
    assert parse_config_args([text]) == {
        "partition-id": 1,
        "num-partitions": 4,
        "data-dir": "/data/my photos/user_01",
        "state-dir": "/state/node 1",
        "device": "auto",
    }
    assert "data-dir" not in parse_config_args([node_config_text(0, 4, None, Path("/s"))])
    on_gpu = node_config_text(0, 4, None, Path("/s"), device="cuda:1")
    assert parse_config_args([on_gpu])["device"] == "cuda:1"


def test_cli_config_is_a_default_tls_connection_for_flower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "tls" / "ca.crt"
    (tmp_path / "config.toml").write_text(federation_toml("127.0.0.1:9092", ca))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    connection = read_superlink_connection()  # the default one, as `flwr run` reads it
    assert connection.name == FEDERATION
    assert connection.address == "127.0.0.1:9092"
    assert connection.root_certificates == str(ca)
    assert not connection.insecure


def fake_collection(root: Path, prefix: str, count: int) -> Path:
    """`root` holding `count` empty folders <prefix>_NN and a marker file (not built)."""
    for index in range(count):
        (root / f"{prefix}_{index:02d}").mkdir(parents=True)
    (root / ("crowd.json" if prefix == "user" else "collection.json")).write_text("{}")
    return root


def test_planner_gives_each_node_its_own_folder(tmp_path: Path) -> None:
    crowd = fake_collection(tmp_path / "crowd", "user", 4)
    data = DataOptions(crowd=crowd)
    scene = plan_nodes(FederatedConfig(), data, {})
    assert scene.folders == tuple(crowd / f"user_{i:02d}" for i in range(4))
    assert scene.data_root == crowd and scene.name == "decentnerf"
    assert plan_nodes(FederatedConfig(), data, {}, users=2).folders == scene.folders[:2]
    with pytest.raises(ValueError, match="has 4 user folders, not --users 5"):
        plan_nodes(FederatedConfig(), data, {}, users=5)
    shared = plan_nodes(FederatedConfig(), data, {}, clients=6)
    assert shared.count == 6 and shared.data_root == crowd.with_name("crowd.x6")
    assert [path.resolve().name for path in shared.folders] == [
        "user_00", "user_01", "user_02", "user_03", "user_00", "user_01",
    ]  # fmt: skip

    objects = fake_collection(tmp_path / "objects", "object", 7)
    config = parse_app_config({"task": "objects", "num-clients": 5})
    meta = plan_nodes(config, DataOptions(objects=objects), {})
    assert meta.folders == tuple(objects / f"object_{i:02d}" for i in range(5))
    assert meta.name == "objects-fedmenf-fedmenf" and meta.eval_scene_dir is not None
    heldout = {path.name for path in meta.eval_scene_dir.iterdir()}
    assert heldout and heldout <= {"object_05", "object_06"}  # never a client's object
    faces = plan_nodes(parse_app_config({"task": "faces"}), data, {})
    assert faces.folders == (None,) * 20 and faces.data_root is None

    split = plan_nodes(parse_app_config({"mode": "split"}), data, {})
    assert split.folders == (data.scene.resolve(),) and split.name == "split"


def test_stop_tree_stops_a_process_and_its_children_and_nothing_else() -> None:
    bystander = subprocess.Popen(["sleep", "60"])
    parent = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert len(tree) == 3 and tree[0] == parent.pid
        stop_tree(parent.pid, grace=5.0)
        parent.wait(timeout=5)
        assert not any(alive(pid) for pid in tree)
        assert alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()


CAPTURED_FAILURE = """\
\x1b[92mINFO \x1b[0m:      [ROUND 3/8]
\x1b[93mWARNING \x1b[0m:   round 3: reply from node 12 dropped (check 'metric'): missing metric
ValueError: a client's own error, logged earlier
\x1b[91mERROR \x1b[0m:     ServerApp thread raised an exception: 3 consecutive rounds
\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):
  File "/app/simulations/server_app.py", line 30, in main
    run_job(grid, context.run_config)
fedfields.flower.strategy.EmptyRoundsError: 3 consecutive rounds (1-3) formed no aggregate: \
16 replies dropped, commonest 'update-norm'
\x1b[92mINFO \x1b[0m:      Run finished 2 round(s)
"""


def test_a_failed_run_is_one_line_naming_the_server_apps_error() -> None:
    assert server_error(CAPTURED_FAILURE) == (
        "EmptyRoundsError: 3 consecutive rounds (1-3) formed no aggregate: 16 replies "
        "dropped, commonest 'update-norm'"
    )
    line = failure_line(7, "finished:failed", CAPTURED_FAILURE)
    assert line.startswith("fedfields: run 7 failed: EmptyRoundsError: 3 consecutive rounds")
    assert "\n" not in line
    assert server_error("INFO : all good\nno error here: just text\n") is None
    quiet = failure_line(7, "finished:failed", "INFO : nothing named\n")
    assert quiet == "fedfields: run 7 failed: it ended as 'finished:failed'; see the log above"


def test_the_staged_app_packs_into_the_fab_flower_builds_from_the_repository(
    tmp_path: Path,
) -> None:
    """Flower's own FAB build is the oracle: from the launchers' staged copy it gives the bytes
    it gives from the repository itself (whose .venv Flower walks file by file)."""
    stage = staged_app(APP_DIR, tmp_path / "app")
    assert build_fab_from_disk(stage) == build_fab_from_disk(APP_DIR)


@pytest.mark.parametrize("reinclude", [False, True])
def test_staging_skips_ignored_folders_and_keeps_what_flower_keeps(
    tmp_path: Path, reinclude: bool
) -> None:
    """A toy app: a .gitignore'd folder (skipped unwalked unless a '!' pattern could re-include
    from it), __pycache__, a symlink and non-packaged files; the FAB matches Flower's."""
    app = tmp_path / "toy"
    (app / "pkg" / "__pycache__").mkdir(parents=True)
    (app / "ignored").mkdir()
    (app / "pyproject.toml").write_text((APP_DIR / "pyproject.toml").read_text())
    (app / ".gitignore").write_text("ignored/\n" + ("!ignored/keep.py\n" if reinclude else ""))
    (app / "pkg" / "module.py").write_text("VALUE = 1\n")
    (app / "pkg" / "__pycache__" / "module.py").write_text("stale\n")
    (app / "pkg" / "weights.bin").write_bytes(b"\0" * 8)
    (app / "ignored" / "keep.py").write_text("HIDDEN = 1\n")
    (app / "pkg" / "link.py").symlink_to(app / "pkg" / "module.py")
    stage = staged_app(app, tmp_path / "stage")
    packaged = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
    reincluded = ["ignored/keep.py"] if reinclude else []  # Flower's pathspec honours the '!'
    assert packaged == [".gitignore", *reincluded, "pkg/module.py", "pyproject.toml"]
    assert build_fab_from_disk(stage) == build_fab_from_disk(app)
