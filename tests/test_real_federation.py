"""A real federation's promises, in process: the server holds no user data, each node reads only
its own folder and keeps its state on the node, nodes with different cameras federate, and
nodes that fail or go away are counted, never fatal."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from fedfields.data import load_scene
from fedfields.data.crowd import CrowdConfig, build_crowd, write_crowd
from fedfields.fields.encodings import tcnn_available
from fedfields.flower import FedAvg
from fedfields.flower.protocol import NUM_FAILURES, NUM_REPLIES, arrays_to_state, state_to_arrays
from fedfields.flower.strategy import InsufficientNodesError
from fedfields.methods.decentnerf import ALPHA_STATE, PREVIOUS_GLOBAL
from fedfields.train.builders import global_field
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid, set_task_identity
from simulations.run import client_app
from strategies import parse_app_config

ROOT = Path(__file__).resolve().parents[1]
LEGO = ROOT / "data" / "lego"

SERVER_OPENS: list[str] = []
"""Files opened while server code runs (the audit hook below records them)."""
_ON_NODE = [False]


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and not _ON_NODE[0] and isinstance(args[0], str | Path):
        SERVER_OPENS.append(str(args[0]))


sys.addaudithook(_record_open)


def on_node(handler: Callable[[Message, Context], Message]) -> Callable:
    """`handler` run as a node: its file opens are the node's, not the server's."""

    def run(message: Message, context: Context) -> Message:
        _ON_NODE[0] = True
        try:
            return handler(message, context)
        finally:
            _ON_NODE[0] = False

    return run


def _crowd(root: Path, downscale: int, users: int) -> Path:
    """A tiny crowd of lego at 200/downscale pixels, 3 views per user."""
    lego = load_scene(LEGO, downscale=downscale, background=(0.0, 0.0, 0.0))
    crowd = build_crowd(lego, CrowdConfig(users=users, views_per_user=3, seed=0), progress=False)
    write_crowd(crowd, root)
    return root


@pytest.fixture(scope="module")
def crowds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two crowds whose users' cameras differ: 25x25 and 20x20 images."""
    root = tmp_path_factory.mktemp("crowds")
    return _crowd(root / "crowd25", 8, 2), _crowd(root / "crowd20", 10, 2)


def deployed_config(run_dir: Path, **overrides: object) -> dict:
    """A deployment's run-config: no data-dir, no state-dir, no observers; tiny settings."""
    return {
        "run-dir": str(run_dir),
        "num-server-rounds": 2,
        "local-steps": 2,
        "fraction-train": 1.0,
        "target-samples": 2048,
        "hash-log2-size": 12,
        "hash-max-resolution": 64,
        "round-timeout": 30.0,
        **overrides,
    }


def deployed_grid(config: dict, user_dirs: list[Path], state_root: Path) -> InProcessGrid:
    """Nodes that know only their own folder and state directory, as deployed SuperNodes."""
    grid = InProcessGrid([on_node(client_app(config))] * len(user_dirs), raise_errors=True)
    for index, (context, user_dir) in enumerate(
        zip(grid.contexts.values(), user_dirs, strict=True)
    ):
        context.node_config["data-dir"] = str(user_dir)
        context.node_config["state-dir"] = str(state_root / f"node_{index}")
    return grid


def test_deployed_server_reads_no_user_data_and_nodes_keep_their_state(
    crowds: tuple[Path, Path], tmp_path: Path
) -> None:
    crowd, _ = crowds
    users = sorted(crowd.glob("user_*"))
    config = deployed_config(tmp_path / "run", strategy="decentnerf")
    grid = deployed_grid(config, users, tmp_path / "nodes")
    SERVER_OPENS.clear()
    run_dir = run_federated_nerf(grid, parse_app_config(config))
    read = [path for path in SERVER_OPENS if str(crowd) in path]
    assert not read, f"the server opened users' files: {read[:3]}"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2]
    assert all(line[NUM_REPLIES] == 2 and 0 < line["client-eval-psnr"] < 60 for line in lines)
    assert "clean-psnr" not in lines[0]  # no observer: nothing scored against ground truth
    # Private state lives in each node's state directory, nothing of it in the run directory.
    for index in range(2):
        kept = {p.name for p in (tmp_path / "nodes" / f"node_{index}").iterdir()}
        assert {"personal-field.pt", f"{PREVIOUS_GLOBAL}.pt", f"{ALPHA_STATE}.json"} <= kept
        history = json.loads(
            (tmp_path / "nodes" / f"node_{index}" / f"{ALPHA_STATE}.json").read_text()
        )
        assert [entry[0] for entry in history["history"]] == [1, 2]
    in_run_dir = {p.name for p in run_dir.iterdir()}
    (events,) = [name for name in in_run_dir if name.startswith("events.out.tfevents.")]
    assert in_run_dir - {events} == {
        "config.json",
        "metrics.jsonl",
        "checkpoint.pt",
        "resume.pt",
        "summary.json",
        "report.html",
        "orbit.gif",  # the server's own final field, orbiting
    }


def test_nodes_with_different_cameras_federate(crowds: tuple[Path, Path], tmp_path: Path) -> None:
    crowd25, crowd20 = crowds
    users = [crowd25 / "user_00", crowd20 / "user_01"]
    sizes = {load_scene(user).cameras.width for user in users}
    assert sizes == {25, 20}
    public = {"eval-scene-dir": str(crowd20 / "heldout"), "eval-views-per-round": 1}
    config = deployed_config(tmp_path / "run", strategy="fedavg", **public)
    run_dir = run_federated_nerf(
        deployed_grid(config, users, tmp_path / "nodes"), parse_app_config(config)
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(line[NUM_REPLIES], line[NUM_FAILURES]) for line in lines] == [(2, 0), (2, 0)]
    assert all(0 < line["eval-scene-psnr"] < 60 for line in lines)  # the public scene
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    assert 0 < final["eval-scene-psnr"] < 60


def test_a_node_without_its_folder_is_a_counted_failure(
    crowds: tuple[Path, Path], tmp_path: Path
) -> None:
    crowd, _ = crowds
    config = deployed_config(tmp_path / "run", strategy="fedavg", **{"min-train-nodes": 1})
    grid = InProcessGrid([client_app(config)] * 2)  # errors become Flower error replies
    grid.contexts[101].node_config["data-dir"] = str(crowd / "user_00")
    grid.contexts[102].node_config["data-dir"] = str(tmp_path / "missing")
    run_dir = run_federated_nerf(grid, parse_app_config(config))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(line[NUM_REPLIES], line[NUM_FAILURES]) for line in lines] == [(1, 1), (1, 1)]
    reasons = [reply.error.reason for reply in grid.received if reply.has_error()]
    assert all("missing" in reason and "does not exist" in reason for reason in reasons)


def test_an_error_reply_from_the_superlink_is_counted_not_raised() -> None:
    """A dead SuperNode's reply comes from the SuperLink (node 1) as NODE_UNAVAILABLE."""

    def honest(message: Message, context: Context) -> Message:
        state = {"w": torch.ones(3)}
        metrics = MetricRecord({"num-examples": 10})
        content = RecordDict({"arrays": state_to_arrays(state), "metrics": metrics})
        return Message(content, reply_to=message)

    grid = InProcessGrid([honest, honest])
    strategy = FedAvg(min_train_nodes=2, min_available_nodes=2, node_timeout=1.0)
    arrays = state_to_arrays({"w": torch.zeros(3)})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    replies = list(grid.send_and_receive(messages[:1]))
    set_task_identity()
    dead = Message(Error(ErrorCode.NODE_UNAVAILABLE, "node went away"), reply_to=messages[1])
    dead.metadata.__dict__["_src_node_id"] = 1
    aggregated, metrics = strategy.aggregate_train(1, [*replies, dead])
    assert metrics[NUM_FAILURES] == 1 and metrics[NUM_REPLIES] == 1
    assert torch.equal(arrays_to_state(aggregated)["w"], torch.ones(3))


def test_too_few_connected_nodes_end_the_run_with_one_clear_error() -> None:
    grid = InProcessGrid([lambda m, c: m])
    strategy = FedAvg(min_train_nodes=2, min_available_nodes=2, node_timeout=0.5)
    arrays = state_to_arrays({"w": torch.zeros(3)})
    with pytest.raises(InsufficientNodesError, match="1 nodes connected .* min-train-nodes = 2"):
        list(strategy.configure_train(1, arrays, ConfigRecord(), grid))


def test_a_node_without_the_run_configs_backend_refuses_clearly() -> None:
    if tcnn_available():
        pytest.skip("this machine has tinycudann and CUDA")
    config = parse_app_config({"hash-backend": "tcnn"})
    with pytest.raises(RuntimeError, match="tinycudann"):
        global_field(config)
