"""The Novel Blender bench's federation runs through fedfields.flower's strategies and round:
its aggregate equals the one formed by hand from each user's local training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedfields.config import FederatedConfig
from fedfields.data.crowd import CrowdData
from fedfields.render import OccupancyGrid
from fedfields.train.builders import client_seed, global_field
from fedfields.train.federated import federated_state, load_federated_state, local_train
from simulations.bench.novel_blender import build_parser, settings_of
from simulations.bench.novel_blender_federation import run_federated
from simulations.bench.novel_blender_setup import (
    Settings,
    parse_run_config,
    personal_field,
    render_config,
)

TINY = Settings(rounds=1, max_steps=2, epochs=0.05, device="cpu", seed=3)


def by_hand(data: CrowdData, config: FederatedConfig, alphas: list[float] | None) -> dict:
    """One round formed outside Flower: each user trains from the same initial field (with
    its personal field when `alphas` is given) and the server takes the weighted mean,
    by num-examples (FedAvg) or by alpha_k (DecentNeRF)."""
    torch.manual_seed(TINY.seed)
    model = global_field(config)
    personals = [
        personal_field(len(user.scene), model.aabb) if alphas is not None else None
        for user in data.users
    ]
    initial = federated_state(model)
    states, weights = [], []
    for index, user in enumerate(data.users):
        load_federated_state(model, initial)
        local = TINY.local(1, index, personal=alphas is not None)
        settings = render_config(config, user.scene)
        result = local_train(model, user.scene, local, settings, OccupancyGrid(model.aabb),
                             personal_field=personals[index])  # fmt: skip
        states.append(federated_state(model))
        weights.append(float(result.num_examples) if alphas is None else alphas[index])
    total = sum(weights)
    return {
        key: sum(w * state[key].double() for w, state in zip(weights, states, strict=True)) / total
        for key in initial
    }


@pytest.mark.parametrize("method", ["decentnerf-l"])
def test_the_bench_aggregate_is_the_hand_formed_one(crowd_dir: Path, method: str) -> None:
    data = CrowdData.load(str(crowd_dir), 1.0)
    config = FederatedConfig.from_run_config({})
    alphas = None if method == "fednerf" else [0.5, 1.0, 2.0][: len(data.users)]
    settings = TINY if alphas is None else Settings(**{**TINY.__dict__,
                                                       "fixed_alphas": tuple(alphas)})  # fmt: skip
    result = run_federated(method, data, config, settings)
    expected = by_hand(data, config, alphas)
    assert result["state"].keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(result["state"][key].double(), value, rtol=1e-5, atol=1e-6)
    assert [record["round"] for record in result["history"]] == [1]
    assert result["alphas"] == [[a] for a in (alphas or [1.0] * len(data.users))]
    leak = "upload-personal-psnr" if method == "fednerf" else "own-personal-personal-psnr"
    assert leak in result["history"][0]
    assert result["rays-drawn"] > 0 and result["rays-dropped"] == 0  # dynamic steps drop none


def test_the_bench_takes_its_seed_and_step_mode_from_the_run_config() -> None:
    """`--run-config "seed=3 cuda-graph=true"` seeds the bench's initial fields and users'
    rounds and selects the captured step; without it, seed 0 and the dynamic step."""
    argv = ["--crowd", "runs/crowd", "--rounds", "2"]
    args = build_parser().parse_args([*argv, "--run-config", "seed=3 cuda-graph=true"])
    run_config = parse_run_config(args.run_config)
    settings = settings_of(args, run_config, FederatedConfig.from_run_config(run_config))
    assert (settings.seed, settings.step_mode, settings.rounds) == (3, "cuda-graph", 2)
    assert settings.local(1, 0, personal=False).seed == client_seed(3, 0, 1)
    default = build_parser().parse_args(argv)
    settings = settings_of(default, {}, FederatedConfig.from_run_config({}))
    assert (settings.seed, settings.step_mode) == (0, "dynamic")
