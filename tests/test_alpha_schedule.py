"""When DecentNeRF's learned weights move (issue 58, point 4), through the App's scene job.

The paper's Algorithm 1 runs every user every merge round, so from round 2 each alpha_k takes
a step. In the App a user's alpha_k steps in round m exactly when its g_k^(m-1) was summed into
the aggregate g^(m-1) that G is taken at (dL/dalpha_k is 0 otherwise): with `fraction-train`
1.0, the paper's schedule, every user steps every round from 2; with fewer users sampled, a user
absent from round m-1 keeps its alpha in round m (the client's rule for that, a stale g_k, is
tested in test_decentnerf.py)."""

from __future__ import annotations

from pathlib import Path

from test_method_digests import SMALL_SCENE

import strategies
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.run import client_app
from simulations.scene_observer import node_alphas

USERS = 3
ROUNDS = 3


def _alphas(crowd_dir: Path, tmp_path: Path, fraction: float) -> dict[int, list[list[float]]]:
    """Each user's alpha history [[round, alpha], ...] after a 3-round DecentNeRF run."""
    config = {**SMALL_SCENE, "num-server-rounds": ROUNDS, "fraction-train": fraction,
              "min-train-nodes": 2, "alpha-lr": 1e3, "data-dir": str(crowd_dir),
              "state-dir": str(tmp_path / "nodes"), "run-dir": str(tmp_path / "run")}  # fmt: skip
    grid = InProcessGrid([client_app(config)] * USERS, raise_errors=True)
    run_federated_nerf(grid, strategies.parse_app_config(config), observe=False)
    histories: dict[int, list[list[float]]] = {}
    for line in node_alphas(str(tmp_path / "nodes")):
        histories.setdefault(line["user"], []).append([line["round"], line["alpha"]])
    return histories


def test_with_every_user_sampled_every_alpha_steps_every_round_from_the_second(
    crowd_dir: Path, tmp_path: Path
) -> None:
    histories = _alphas(crowd_dir, tmp_path, 1.0)
    assert sorted(histories) == list(range(USERS))
    for user, history in histories.items():
        assert [round_ for round_, _ in history] == [1, 2, 3], user
        alphas = [alpha for _, alpha in history]
        assert alphas[0] == 1.0  # no G in round 1
        assert alphas[1] != alphas[0] and alphas[2] != alphas[1], (user, alphas)
