"""Splat fields in the federation (issue 59): run-config scene-field 'splats' through the App's
strategies, SecAgg+, compression and DP, DecentNeRF's personal splats kept on the node, and
the splat client's loss gradient against one computed another way."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord
from test_federated_nerf import _run_in_process, tiny

from clients.scene_client import APPEARANCE, PERSONAL
from fedfields.data.scene import load_scene
from fedfields.fields import SplatAppearance, SplatField, SplatFieldConfig
from fedfields.fields.splats import Gaussians
from fedfields.flower.protocol import arrays_to_state
from fedfields.methods import ALPHA_KEY
from fedfields.render.splatting import render_splats
from fedfields.train.checkpoint import load_checkpoint
from fedfields.train.federated import LocalTrainConfig, federated_state
from fedfields.train.splats import local_train_splats, splat_loss_gradient
from simulations.federated_nerf import run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.run import client_app
from strategies import parse_app_config

SPLATS = {
    "scene-field": "splats",
    "splat-count": 256,
    "personal-splat-count": 64,
    "local-steps": 4,
}
HASH_ONLY = ("hash-log2-size", "hash-levels", "hash-max-resolution", "target-samples")


def splat_config(crowd_dir: Path, run_dir: Path, strategy: str, **overrides: object) -> dict:
    """`tiny`'s run with a splat field of 256 Gaussians instead of its hash grid."""
    config = tiny(crowd_dir, run_dir, strategy, **SPLATS, **overrides)
    for key in HASH_ONLY:
        config.pop(key)
    return config


def test_a_splat_run_federates_under_secagg_with_compressed_uploads_and_downloads(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """FedAvg on splats with SecAgg+ and 8-bit uploads and downloads: both rounds sum all
    three users securely, the global keeps the run-config's 256 Gaussians and the checkpoint
    is a splat field the renderer reads. (DP on splats: the DecentNeRF test below.)"""
    run_dir = tmp_path / "run"
    private = {"secure-aggregation": True, "min-train-nodes": 3, "compression": "quantise",
               "compression-download": True, "client-eval-views": 0}  # fmt: skip
    _run_in_process(splat_config(crowd_dir, run_dir, "fedavg", **private))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(line["round"], line["num-replies"], line["secure-sums"]) for line in lines] == [
        (1, 3, 1),
        (2, 3, 1),
    ]
    assert lines[1]["bytes-down"] < lines[0]["bytes-down"] / 2  # the 8-bit change of round 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["secure-aggregation"]["protocol"] == "Flower SecAgg+"
    field, _, occupancy, _ = load_checkpoint(run_dir / "checkpoint.pt")
    assert isinstance(field, SplatField) and occupancy is None
    assert field.means.shape == (256, 3) and torch.isfinite(field.means).all()


def test_decentnerf_splats_keep_the_personal_gaussians_on_the_node(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """DecentNeRF on splats under central DP: each node keeps 64 personal Gaussians and a
    colour map per training view, the gradient query and the learned alpha run, epsilon is
    charged each round, and no reply carries a personal tensor or any tensor beyond the
    shared set's."""
    run_dir = tmp_path / "run"
    # z small enough that the noised sum of three alphas stays positive (at z = 1 it need not)
    dp = {"dp-noise-multiplier": 0.01, "dp-clip-norm": 1.0, "dp-max-noise-ratio": 0.0}
    config = splat_config(crowd_dir, run_dir, "decentnerf", **dp, **{"splat-appearance": True})
    _, grid = _run_in_process(config)
    nodes = sorted(run_dir.with_name(run_dir.name + ".nodes").glob("node_*"))
    splats = [torch.load(node / f"{PERSONAL}.pt", weights_only=True) for node in nodes]
    maps = [torch.load(node / f"{APPEARANCE}.pt", weights_only=True) for node in nodes]
    assert len(splats) == 3 and all(state["params.means"].shape == (64, 3) for state in splats)
    identity = SplatAppearance(1).affine[0]
    for state in maps:  # the 2 views a user trains on (one of 3 held out), each map trained
        assert state["affine"].shape == (2, 3, 4) and not torch.equal(state["affine"][0], identity)
    kept = splats + maps
    shared = set(federated_state(SplatField(SplatFieldConfig(count=256, sh_degree=1))))
    kinds = []
    for reply in grid.received:
        if reply.has_error():
            continue
        kinds.append(reply.metadata.message_type)
        for name, record in reply.content.items():
            if not isinstance(record, ArrayRecord):
                continue
            state = arrays_to_state(record)
            assert set(state) - {ALPHA_KEY} == shared, f"reply record {name!r}"
            for sent in state.values():
                for personal in kept:
                    for tensor in personal.values():
                        same = sent.shape == tensor.shape and torch.equal(sent, tensor)
                        assert not same, f"reply record {name!r} holds a personal tensor"
    assert kinds.count("query.gradient") == 3, kinds  # round 2's gradient query
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < line["clean-psnr"] < 60 for line in lines)
    assert 0 < lines[0]["dp-epsilon"] < lines[1]["dp-epsilon"]


def test_the_server_relocates_dead_splats_from_the_aggregate_under_dp(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """FedAvg on splats under central DP with relocation every round: the opacity regulariser
    fades Gaussians below splat-min-opacity, the server moves them onto live ones after each
    round's noised aggregate (counted in metrics.jsonl, most by round 2), epsilon is charged
    as without it, and the final global holds no dead Gaussian and the run-config's count."""
    run_dir = tmp_path / "run"
    dp = {"dp-noise-multiplier": 0.01, "dp-clip-norm": 1.0, "dp-max-noise-ratio": 0.0}
    structure = {"splat-relocate-every": 1, "splat-min-opacity": 0.09,
                 "splat-opacity-weight": 1.0, "client-eval-views": 0}  # fmt: skip
    _run_in_process(splat_config(crowd_dir, run_dir, "fedavg", **dp, **structure))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["splats-relocated"] >= 0 for line in lines] == [True, True]
    assert lines[1]["splats-relocated"] > 10  # round 1's clipped update faded too few
    assert 0 < lines[0]["dp-epsilon"] < lines[1]["dp-epsilon"]
    field, _, _, _ = load_checkpoint(run_dir / "checkpoint.pt")
    assert isinstance(field, SplatField) and field.means.shape == (256, 3)
    assert bool((field.opacities >= 0.09 - 1e-6).all())


def test_a_node_refuses_a_splat_run_above_its_max_splats(crowd_dir: Path, tmp_path: Path) -> None:
    """A deployed node whose node-config `max-splats` is below the shared plus personal
    Gaussians refuses the run before building them, naming the key and the counts."""
    config = splat_config(crowd_dir, tmp_path / "run", "decentnerf")
    grid = InProcessGrid([client_app(config)] * 2, raise_errors=True)
    for index, node_id in enumerate(grid.contexts):
        grid.contexts[node_id].node_config = {
            "partition-id": index, "num-partitions": 2,
            "data-dir": str(crowd_dir / f"user_{index:02d}"),
            "state-dir": str(tmp_path / f"node_{index}"), "max-splats": 300 + 100 * index,
        }  # fmt: skip
    with pytest.raises(ValueError, match=r"'max-splats' is 300: .* needs 256 shared \+ 64 perso"):
        run_federated_nerf(grid, parse_app_config(config), observe=False)


@pytest.fixture(scope="module")
def small_scene(crowd_dir: Path):
    """One user's 2 training views at 25x25."""
    return load_scene(crowd_dir / "user_00", downscale=1).subset([0, 1])


def test_a_user_s_appearance_learns_a_darker_view_s_exposure(small_scene) -> None:
    """Two views, the second photographed at 0.6 of the exposure: seeded local training with
    per-view colour maps lowers the second map's gain below the first's (the shared
    Gaussians need not learn the exposure), and the maps start as the identity."""
    darker = replace(small_scene, images=small_scene.images * torch.tensor([[[[1.0]]], [[[0.6]]]]))
    appearance = SplatAppearance(2)
    image = torch.rand(5, 4, 3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(appearance(image, 1), image)
    field = SplatField(SplatFieldConfig(count=128, sh_degree=1, seed=3))
    local_train_splats(field, darker, LocalTrainConfig(steps=60, seed=5), appearance=appearance)
    gains = appearance.affine.detach()[:, :, :3].diagonal(dim1=1, dim2=2).mean(dim=1)
    assert float(gains[1]) < float(gains[0]) - 0.02, gains


def test_the_splat_loss_gradient_is_the_mean_over_views_of_each_views_gradient(
    small_scene,
) -> None:
    """G_k of `splat_loss_gradient` equals the gradient of the L1 losses' mean over the
    views taken by one backward pass, the personal and shared opacity terms included, and
    leaves no .grad behind."""
    shared = SplatField(SplatFieldConfig(count=64, sh_degree=1, seed=1))
    personal = SplatField(SplatFieldConfig(count=16, sh_degree=1, seed=2))
    weight, opacity_weight = 0.3, 0.2
    gradient = splat_loss_gradient(
        shared, small_scene, personal, weight, opacity_weight=opacity_weight
    )
    assert all(p.grad is None for p in shared.parameters())
    background = torch.tensor(small_scene.background)
    loss = torch.zeros(())
    for view in range(len(small_scene)):
        joined = Gaussians.joined(shared.gaussians(), personal.gaussians())
        rendered, _ = render_splats(joined, small_scene.cameras, view, background)
        loss = loss + (rendered - small_scene.images[view]).abs().mean()
    loss = loss / len(small_scene) + weight * personal.opacities.mean()
    loss = loss + opacity_weight * shared.opacities.mean()
    loss.backward()
    for name, parameter in shared.named_parameters():
        torch.testing.assert_close(gradient[name], parameter.grad, rtol=1e-5, atol=1e-7)


def test_local_splat_training_keeps_the_structure_and_lowers_the_loss(small_scene) -> None:
    """A round of local splat training from a seed: the Gaussian count is the server's, the
    loss falls, and the same seed trains the same tensors."""

    def trained() -> tuple[dict, float, float]:
        field = SplatField(SplatFieldConfig(count=128, sh_degree=1, seed=3))
        first = local_train_splats(field, small_scene, LocalTrainConfig(steps=1, seed=5))
        result = local_train_splats(field, small_scene, LocalTrainConfig(steps=30, seed=5))
        return federated_state(field), first.loss, result.loss

    state, before, after = trained()
    again, _, _ = trained()
    assert state["params.means"].shape == (128, 3)
    assert after < before
    assert all(torch.equal(state[key], again[key]) for key in state)


def test_the_parser_names_the_keys_a_splat_field_never_reads(crowd_dir: Path) -> None:
    """Under scene-field 'splats' a hash-grid key or the ray batch is refused by name, and a
    splat key under the hash grid too."""
    config = splat_config(crowd_dir, crowd_dir / "unused", "fedavg")
    with pytest.raises(
        ValueError, match="'hash-levels' = 4 is read only with scene-field='hashgrid'"
    ):
        parse_app_config({**config, "hash-levels": 4})
    with pytest.raises(ValueError, match="'target-samples' .* scene-field='hashgrid' or 'mlp'"):
        parse_app_config({**config, "target-samples": 4096})
    plain = tiny(crowd_dir, crowd_dir / "unused", "fedavg")
    with pytest.raises(
        ValueError, match="'splat-count' = 64 is read only with scene-field='splats'"
    ):
        parse_app_config({**plain, "splat-count": 64})
    with pytest.raises(ValueError, match="'splat-relocate-every' = 2 is read only with scene-f"):
        parse_app_config({**plain, "splat-relocate-every": 2})
    with pytest.raises(ValueError, match="'splat-min-opacity' must be in \\(0, 1\\), got 1.5"):
        parse_app_config({**config, "splat-min-opacity": 1.5})
