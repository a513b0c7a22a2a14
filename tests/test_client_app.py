"""The repo's ClientApp (`clients.client_app.app`) as a SuperNode runs it, fed hand-built server
messages: each message's run-config is parsed once, the run's client half answers it, and a
round's reply carries the client's seconds with this round's gradient query counted once."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from test_meta_job import tiny as tiny_meta

import clients.client_app as client_app
import fedfields.train.federated as federated
from clients.halves import HALVES, client_half, half_for
from fedfields.config import FederatedConfig, meta_settings
from fedfields.config.schema import MODES, TASKS
from fedfields.flower.protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_INDEX,
    CLIENT_SECONDS,
    CONFIG,
    EMBEDDINGS,
    GRADIENT,
    GRADIENT_QUERY,
    LOCAL_STEPS,
    METRICS,
    NUM_EXAMPLES,
    SAMPLES,
    SERVER_PART,
    SERVER_ROUND,
    SPLIT_STAGE,
    SPLIT_STEP,
    STRATEGY,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.privacy import split_field
from fedfields.train.builders import global_field, joint_field, meta_model
from fedfields.train.federated import federated_state
from simulations.in_process_grid import InProcessGrid, NodeHandler
from strategies import parse_app_config

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"

SCENE = {
    "strategy": "decentnerf",
    "local-steps": 1,
    "target-samples": 2048,
    "hash-log2-size": 10,
    "hash-levels": 2,
    "hash-max-resolution": 32,
    "client-eval-views": 0,  # no held-out score: the handlers' cost is local training
}
SPLIT = {
    "mode": "split",
    "data-dir": str(LEGO),
    "downscale": 8.0,
    "split-steps": 2,
    "split-batch-rays": 16,
    "split-samples": 8,
    "hash-log2-size": 10,
}


class ParseCounter:
    """Counts `FederatedConfig.from_run_config` calls per message the node handles."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.per_message: list[int] = []
        self._inside = False
        real = FederatedConfig.from_run_config

        def counted(run_config: Mapping[str, Any], strategies: Any = None) -> FederatedConfig:
            if self._inside:
                self.per_message[-1] += 1
            return real(run_config, strategies)

        monkeypatch.setattr(FederatedConfig, "from_run_config", staticmethod(counted))

    def node(self, msg: Message, context: Context) -> Message:
        """The ClientApp on this node, with its parses counted."""
        self.per_message.append(0)
        self._inside = True
        try:
            return client_app.app(msg, context)
        finally:
            self._inside = False


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> ParseCounter:
    return ParseCounter(monkeypatch)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The app's clock, reading the given instants in turn (each handler reads it twice)."""
    instants: list[float] = []
    monkeypatch.setattr(client_app, "time", SimpleNamespace(perf_counter=lambda: instants.pop(0)))
    yield instants
    assert not instants, "the app read the clock fewer times than scripted"


def node_grid(handler: NodeHandler, run_config: dict, tmp_path: Path) -> InProcessGrid:
    """One simulated node (partition 0) running `handler`, its state in `tmp_path`/nodes."""
    config = run_config | {"state-dir": str(tmp_path / "nodes"), "run-dir": str(tmp_path / "run")}
    return InProcessGrid([handler], run_config=config, raise_errors=True)


def send(grid: InProcessGrid, content: dict, message_type: str = "train") -> Message:
    """`content` (record name -> record) to the grid's one node; its reply."""
    (node_id,) = grid.get_node_ids()
    message = Message(RecordDict(content), dst_node_id=node_id, message_type=message_type)
    (reply,) = grid.send_and_receive([message])
    return reply


def scene_content(run_config: dict, server_round: int) -> dict:
    """A DecentNeRF server's message of `server_round`: a fresh global field and its CONFIG."""
    field = global_field(parse_app_config(run_config))
    config = {SERVER_ROUND: server_round, STRATEGY: "decentnerf", LOCAL_STEPS: 1}
    return {ARRAYS: state_to_arrays(federated_state(field)), CONFIG: ConfigRecord(config)}


def metrics(reply: Message) -> dict:
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    return dict(reply.content[METRICS])


# ------------------------------------------------------------------ one parse per message, timing


def test_scene_rounds_parse_once_per_message_and_time_the_query_once(
    crowd_dir: Path, tmp_path: Path, counter: ParseCounter, clock: list[float]
) -> None:
    """DecentNeRF on one node. Round 2: a 3 s gradient query, then a 5 s train: the reply's
    client-seconds are 8. Round 3 without a query: 5 (round 2's query is not counted again).
    Each of the three messages parses the run-config once."""
    config = SCENE | {"data-dir": str(crowd_dir)}
    grid = node_grid(counter.node, config, tmp_path)
    clock.extend([100.0, 103.0, 200.0, 205.0, 300.0, 305.0])
    query = send(grid, scene_content(config, 2), GRADIENT_QUERY)
    round_two = send(grid, scene_content(config, 2))
    round_three = send(grid, scene_content(config, 3))
    assert counter.per_message == [1, 1, 1]
    assert set(query.content) == {GRADIENT}
    assert set(round_two.content) == {ARRAYS, METRICS, CLIENT}
    assert round_two.content[CLIENT][CLIENT_INDEX] == 0
    assert metrics(round_two)[CLIENT_SECONDS] == 8.0
    assert metrics(round_three)[CLIENT_SECONDS] == 5.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA node captures; this checks a CPU one")
def test_a_decentnerf_round_asked_for_cuda_graph_runs_static_steps_on_a_cpu_node(
    crowd_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run-config `cuda-graph = true` with DecentNeRF (issue 44): a node without CUDA warns
    and trains its global and personal fields in the static step, NeRF-W's loss included."""
    personal_losses: list[bool] = []
    real = federated.static_loss

    def spied(*args: Any, **kwargs: Any):
        personal_losses.append(kwargs["personal"] is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(federated, "static_loss", spied)
    config = SCENE | {"data-dir": str(crowd_dir), "cuda-graph": True}
    grid = node_grid(client_app.app, config, tmp_path)
    content = scene_content(config, 1)
    sent = arrays_to_state(content[ARRAYS])
    with pytest.warns(RuntimeWarning, match="step mode 'cuda-graph' needs CUDA; this node"):
        reply = send(grid, content)
    assert personal_losses == [True]  # one local step (the config's 1) with NeRF-W's loss
    trained = arrays_to_state(reply.content[ARRAYS])
    assert all(torch.isfinite(value).all() for value in trained.values())
    assert any(not torch.equal(trained[name], sent[name]) for name in sent)


def test_meta_train_parses_the_run_config_once(tmp_path: Path, counter: ParseCounter) -> None:
    config = tiny_meta(tmp_path / "run", strategy="fedmenf")
    parsed = parse_app_config(config)
    theta = federated_state(meta_model(parsed, meta_settings(parsed)))
    grid = node_grid(counter.node, config, tmp_path)
    round_config = ConfigRecord({SERVER_ROUND: 1, STRATEGY: "fedmenf"})
    reply = send(grid, {ARRAYS: state_to_arrays(theta), CONFIG: round_config})
    assert counter.per_message == [1]
    assert set(reply.content) == {ARRAYS, METRICS, CLIENT}
    assert {NUM_EXAMPLES, CLIENT_SECONDS} <= set(metrics(reply))


def test_split_stages_parse_once_and_carry_no_round_entries(
    tmp_path: Path, counter: ParseCounter
) -> None:
    """start, step 0 (zero embeddings of the right shape) and finish: one parse each; split
    replies carry neither client-seconds nor the CLIENT record, as before."""
    config = SPLIT
    server, _ = split_field(joint_field(parse_app_config(config)))
    grid = node_grid(counter.node, config, tmp_path)
    start = send(grid, {CONFIG: ConfigRecord({SPLIT_STAGE: "start"})})
    assert set(start.content) == {SAMPLES}
    rays = config["split-batch-rays"] * config["split-samples"]
    embeddings = state_to_arrays({"embeddings": torch.zeros(rays, server.embedding_dim)})
    step = send(
        grid,
        {EMBEDDINGS: embeddings, CONFIG: ConfigRecord({SPLIT_STAGE: "step", SPLIT_STEP: 0})},
    )
    assert set(step.content) == {GRADIENT, SAMPLES, METRICS}
    assert set(metrics(step)) == {"loss", "psnr"}
    finish = send(
        grid,
        {
            SERVER_PART: state_to_arrays(server.state_dict()),
            CONFIG: ConfigRecord({SPLIT_STAGE: "finish"}),
        },
    )
    assert set(finish.content) == {METRICS}
    assert CLIENT_SECONDS not in metrics(finish)
    assert counter.per_message == [1, 1, 1]


# ------------------------------------------------------------------ the registry


def test_every_valid_mode_and_task_has_its_half() -> None:
    """Each run-config the schema accepts picks the half named for it."""
    picked = {}
    for mode in MODES:
        for task in TASKS:
            try:
                config = parse_app_config({"mode": mode, "task": task})
            except ValueError:
                continue  # split trains a scene only
            picked[mode, task] = half_for(config).name
    expected = {("federated", task): "meta" for task in TASKS if task != "scene"}
    assert picked == expected | {("federated", "scene"): "scene", ("split", "scene"): "split"}
    assert {half.name for half in HALVES} == {"scene", "meta", "split"}


def test_an_unknown_mode_or_task_is_one_error_naming_key_and_value() -> None:
    with pytest.raises(ValueError, match=r"'mode' 'serial' has no client half; known: federated"):
        client_half("serial", "scene")
    with pytest.raises(ValueError, match=r"'task' 'poems' has no client half in mode 'federated'"):
        client_half("federated", "poems")
    with pytest.raises(ValueError, match=r"'task' 'faces' has no client half in mode 'split'"):
        client_half("split", "faces")


def test_a_gradient_query_to_a_half_without_one_is_refused(tmp_path: Path) -> None:
    grid = node_grid(client_app.app, tiny_meta(tmp_path / "run"), tmp_path)
    grid.raise_errors = False
    reply = send(grid, {CONFIG: ConfigRecord({SERVER_ROUND: 1})}, GRADIENT_QUERY)
    assert reply.has_error() and "the meta client answers no gradient query" in reply.error.reason
