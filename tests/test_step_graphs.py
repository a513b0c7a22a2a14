"""One CUDA graph per batch size for a node's whole run (issue 55, point 3).

`StepGraphs` keeps a static step's workspace (fields, Adam, pixels, FedProx's reference,
Scaffold's buffers) across users and rounds and refills its tensors in place, so graphs
captured on them replay for every later call of the same kind. On the CPU this checks what
a graph depends on: training in the shared workspace gives each user a fresh workspace's
numbers bit for bit, no tensor a graph reads is ever rebound, and captures (counted under a
stand-in for torch.cuda's capture) happen once per batch size instead of once per batch
size, user and round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from graph_replay import assert_replays_match, deterministic_kernels
from test_host_syncs import _personal, _scaffold  # the same tiny personal field and controls
from tiny_fields import tiny_grid, tiny_hashgrid_setup

from fedfields.data import holdout_indices, load_scene
from fedfields.data.scene import Scene
from fedfields.methods.fedprox import ProximalHook
from fedfields.methods.scaffold import CLIENT_CONTROL, ScaffoldHook
from fedfields.render import OccupancyGrid
from fedfields.train import federated
from fedfields.train.federated import (
    LocalTrainConfig,
    LocalTrainResult,
    LocalWorkspace,
    StepGraphs,
    local_train,
)

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
USERS = 3
STEPS_PER_CALL = 12
"""Local steps of a capture-counting call: six grid refreshes, enough for several batch sizes
(at 8 some calls capture none: their batch sizes only settle later)."""


@pytest.fixture(scope="module")
def users() -> list[Scene]:
    """Three users' scenes of the same size: disjoint views of the tiny lego."""
    scene = load_scene(LEGO, downscale=8)
    views = holdout_indices(len(scene), 8)[0][: 6 * USERS]
    return [scene.subset(views[user::USERS]) for user in range(USERS)]


def _round(
    scene: Scene,
    user: int,
    federated_round: int,
    graphs: StepGraphs | None,
    steps: int = 6,
    step_mode: str = "static",
) -> tuple[LocalTrainResult, list[torch.Tensor]]:
    """One user's DecentNeRF round with FedProx's term and Scaffold's correction (every
    buffer a workspace refills), its weights seeded by user and round."""
    setup = tiny_hashgrid_setup(scene)
    torch.manual_seed(1000 * federated_round + user)
    field = type(setup.field)(setup.field.config)
    personal = _personal(len(scene), seed=user)
    grid = tiny_grid(field)
    config = LocalTrainConfig(
        steps=steps, batch_rays=256, target_samples=1 << 12, max_batch_rays=1024,
        occupancy_update_every=2, learning_rate=1e-2 * (1 + federated_round),
        seed=federated_round * 10 + user, device="cpu", step_mode=step_mode,
    )  # fmt: skip
    hooks = [ProximalHook(0.01), _scaffold(field, seed=user + 7 * federated_round)]
    result = local_train(
        field, scene, config, setup.render_config, grid, personal, hooks, graphs=graphs
    )
    return result, [p.detach().clone() for p in (*field.parameters(), *personal.parameters())]


def test_the_shared_workspace_trains_each_user_as_a_fresh_one_does(users: list[Scene]) -> None:
    """Users 0, 1, 2 in round 0, then 2 and 0 in round 1, through one `StepGraphs` and each
    in a fresh workspace: the same losses, weights (both fields) and Scaffold controls, bit
    for bit; the cache never writes into a caller's scene."""
    pixels = [scene.images.clone() for scene in users]
    graphs = StepGraphs()
    calls = [(0, 0), (1, 0), (2, 0), (2, 1), (0, 1)]
    for user, federated_round in calls:
        shared, shared_weights = _round(users[user], user, federated_round, graphs)
        fresh, fresh_weights = _round(users[user], user, federated_round, None)
        assert (shared.loss, shared.steps, shared.rays, shared.samples) == (
            fresh.loss, fresh.steps, fresh.rays, fresh.samples,
        )  # fmt: skip
        for got, expected in zip(shared_weights, fresh_weights, strict=True):
            assert torch.equal(got, expected)
        shared_control = shared.hook_results[1].kept[CLIENT_CONTROL]
        for name, value in fresh.hook_results[1].kept[CLIENT_CONTROL].items():
            assert torch.equal(shared_control[name], value)
    assert len(graphs.workspaces) == 1
    for scene, before in zip(users, pixels, strict=True):
        assert torch.equal(scene.images, before)


def _addresses(workspace: LocalWorkspace) -> dict[str, int]:
    """Where every tensor a captured step reads lives."""
    tensors = {f"field.{n}": t for n, t in workspace.field.state_dict(keep_vars=True).items()}
    for index, state in enumerate(workspace.optimizer.state.values()):
        tensors |= {f"adam.{index}.{key}": value for key, value in state.items()}
    tensors |= {f"lr.{i}": g["lr"] for i, g in enumerate(workspace.optimizer.param_groups)}
    sampler = workspace.sampler
    tensors |= {
        "colors": sampler.colors, "transparency": sampler.transparency,
        "background": sampler.background, "poses": sampler.cameras.camera_to_world,
        "fx": sampler.cameras.fx,
    }  # fmt: skip
    proximal, scaffold = workspace.hooks
    assert isinstance(proximal, ProximalHook) and isinstance(scaffold, ScaffoldHook)
    tensors |= {f"reference.{n}": t for n, t in proximal.device_reference.items()}
    tensors |= {f"correction.{n}": t for n, t in scaffold.correction.items()}
    tensors |= {f"gradient_sum.{n}": t for n, t in scaffold.gradient_sum.items()}
    return {name: tensor.data_ptr() for name, tensor in tensors.items()}


def test_refilling_rebinds_no_tensor_a_graph_reads(users: list[Scene]) -> None:
    graphs = StepGraphs()
    _round(users[0], 0, 0, graphs)
    (workspace,) = graphs.workspaces.values()
    before = _addresses(workspace)
    for user, federated_round in [(1, 0), (2, 1), (0, 2)]:
        _round(users[user], user, federated_round, graphs)
        assert graphs.workspaces[next(iter(graphs.workspaces))] is workspace
        assert _addresses(workspace) == before


class _CountedGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: capture runs the step once, as a
    capture followed by its first replay would; later replays do nothing."""

    def replay(self) -> None:
        pass


@pytest.fixture
def counted_captures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch.cuda's capture, streams and device guard stood in for on the CPU; yields the
    batch sizes captured, in order."""
    captured: list[int] = []

    @contextlib.contextmanager
    def capture(graph: object) -> Iterator[None]:
        captured.append(0)
        yield

    class Stream:
        def __init__(self, device: object = None) -> None:
            pass

        def wait_stream(self, other: object) -> None:
            pass

    monkeypatch.setattr(federated, "graphs_supported", lambda device: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _CountedGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    yield captured


def test_one_capture_per_batch_size_serves_every_user_and_round(
    users: list[Scene], counted_captures: list[int]
) -> None:
    """Three users over two rounds, 12 steps each (a grid refresh, and so possibly a new
    batch size, every 2): a fresh workspace per call captures every batch size of every
    call; the shared one captures each batch size once for the whole run."""
    per_call = []
    for federated_round in range(2):
        for user in range(USERS):
            graphs = StepGraphs()
            _round(users[user], user, federated_round, graphs, STEPS_PER_CALL, "cuda-graph")
            (workspace,) = graphs.workspaces.values()
            per_call.append(set(workspace.step.graphs))
            assert graphs.captures == len(workspace.step.graphs)
    before = len(counted_captures)
    assert before == sum(len(sizes) for sizes in per_call) > len(per_call)
    counted_captures.clear()
    shared = StepGraphs()
    for federated_round in range(2):
        for user in range(USERS):
            _round(users[user], user, federated_round, shared, STEPS_PER_CALL, "cuda-graph")
    (workspace,) = shared.workspaces.values()
    after = len(counted_captures)
    # one capture per distinct batch size (graphs are keyed by it); the sizes themselves need
    # not be the fresh calls' ones: the stand-in's replays do not train, so after a size's
    # first capture the shared run's fields, grids and later sizes follow another course
    assert after == shared.captures == len(workspace.step.graphs)
    assert after < before


def test_a_call_of_another_kind_gets_its_own_workspace_and_the_oldest_goes(
    users: list[Scene],
) -> None:
    """Another scene size, or FedProx turned off, bakes other shapes or terms into a graph:
    such calls get a workspace of their own; beyond `max_workspaces` the least recently used
    one is dropped, its captures still counted."""
    graphs = StepGraphs(max_workspaces=2)
    _round(users[0], 0, 0, graphs)
    _round(users[1].subset([0, 1, 2]), 1, 0, graphs)  # three views, not six
    assert len(graphs.workspaces) == 2
    first = next(iter(graphs.workspaces.values()))
    _round(users[0], 0, 1, graphs)  # the six-view kind again: now the most recent
    assert next(reversed(graphs.workspaces.values())) is first
    setup = tiny_hashgrid_setup(users[2])
    config = LocalTrainConfig(steps=2, batch_rays=256, device="cpu", step_mode="static")
    local_train(setup.field, users[2], config, setup.render_config, setup.occupancy, graphs=graphs)
    assert len(graphs.workspaces) == 2 and first in graphs.workspaces.values()
    assert graphs.captures == 0  # on the CPU nothing is captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_shared_across_users_replay_each_user_s_round(
    users: list[Scene],
) -> None:
    """On CUDA: users trained one after another on the shared graphs end where each one's
    own uncaptured static round ends (deterministic kernels, so only capture differs)."""
    shared = StepGraphs()
    with deterministic_kernels():
        for user in range(USERS):
            scene = users[user].to("cuda")
            runs = {}
            for mode, graphs in (("cuda-graph", shared), ("static", None)):
                result, weights = _round_on_cuda(scene, user, graphs, mode)
                loss = torch.tensor([result.loss], dtype=torch.float64)
                runs[mode] = (loss, torch.cat([w.reshape(-1) for w in weights]))
            (loss, weights), (expected_loss, expected) = runs["cuda-graph"], runs["static"]
            assert_replays_match(loss, expected_loss, weights, expected)
    (workspace,) = shared.workspaces.values()
    assert shared.captures == len(workspace.step.graphs) > 0


def _round_on_cuda(
    scene: Scene, user: int, graphs: StepGraphs | None, step_mode: str
) -> tuple[LocalTrainResult, list[torch.Tensor]]:
    setup = tiny_hashgrid_setup(scene)
    torch.manual_seed(user)
    field = type(setup.field)(setup.field.config)
    personal = _personal(len(scene), seed=user)
    config = LocalTrainConfig(
        steps=12, batch_rays=256, target_samples=1 << 12, max_batch_rays=1024,
        occupancy_update_every=4, seed=user, device="cuda", step_mode=step_mode,
    )  # fmt: skip
    grid = OccupancyGrid(field.aabb)
    result = local_train(field, scene, config, setup.render_config, grid, personal, graphs=graphs)
    return result, [p.detach().cpu() for p in (*field.parameters(), *personal.parameters())]
