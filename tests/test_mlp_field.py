"""DecentNeRF's paper fields as a run-config choice (`scene-field = "mlp"`, issue 58 point 2):
the global NeRF MLP with its colour head and the personal MLP, sampled 64 + 64 per ray without
an occupancy grid, through the same App as the hash grid."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_method_digests import SMALL_SCENE

import strategies
from fedfields.fields import NeRFField, PersonalField
from fedfields.fields.base import trunc_exp
from fedfields.fields.personal import GlobalPersonalField
from fedfields.geometry import Rays
from fedfields.render import render_rays
from fedfields.train.builders import (
    global_field,
    marches,
    personal_field_config,
    render_config,
)
from fedfields.train.evaluation import FieldRenderer
from fedfields.train.nerfw import nerfw_loss
from simulations.in_process_grid import InProcessGrid

TINY_MLP = {
    "scene-field": "mlp", "field-width": 16, "field-depth": 3, "mlp-samples": 8,
    "mlp-importance": 8, "personal-width": 8,
}  # fmt: skip
"""The paper's fields at a width and sample count a test runs in seconds."""
SCENE = {key: value for key, value in SMALL_SCENE.items() if not key.startswith("hash-")}
"""The digest tests' small scene without its hash-grid keys (an MLP run reads none)."""


def linear(inputs: int, outputs: int) -> int:
    """Parameters of one fully connected layer with bias."""
    return inputs * outputs + outputs


def test_the_paper_fields_have_the_papers_layers() -> None:
    """Parameter counts from the paper's appendix C layer list, counted by hand: global 8 x 256
    on NeRF's 63-wide point encoding with its skip at layer 5, a 4 x 128 colour MLP on the
    27-wide direction encoding; personal 4 x 128 on the point encoding and an 8-wide
    transient embedding."""
    config = strategies.parse_app_config({"scene-field": "mlp"})
    field = global_field(config)
    assert isinstance(field, NeRFField)
    points, directions = 3 + 3 * 2 * 10, 3 + 3 * 2 * 4
    trunk = linear(points, 256) + 6 * linear(256, 256) + linear(256 + points, 256)
    colour = linear(256 + directions, 128) + 3 * linear(128, 128) + linear(128, 3)
    expected = trunk + linear(256, 1) + linear(256, 256) + colour
    assert sum(p.numel() for p in field.parameters()) == expected
    settings = render_config(config, None)
    assert (settings.num_samples, settings.num_importance) == (64, 64)
    personal = PersonalField(personal_field_config(config, settings, num_images=5))
    heads = linear(points + 8, 128) + 3 * linear(128, 128) + linear(128, 2 + 15)
    heads += linear(15 + 8, 128) + linear(128, 3)
    embeddings = 2 * 5 * 8
    assert sum(p.numel() for p in personal.parameters()) == heads + embeddings


def test_the_mlp_renders_without_an_occupancy_grid() -> None:
    config = strategies.parse_app_config(TINY_MLP)
    assert not marches(config)
    renderer = FieldRenderer(config, device="cpu")
    renderer.load({k: v.detach() for k, v in renderer.field.state_dict().items()})
    assert renderer.occupancy is None
    hashgrid = FieldRenderer(strategies.parse_app_config({}), device="cpu")
    assert hashgrid.occupancy is not None


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"scene-field": "mlp", "hash-levels": 4}, "hash-levels"),
        ({"mlp-samples": 32}, "mlp-samples"),
        ({"field-depth": 4}, "field-depth"),
        ({"scene-field": "mlp", "cuda-graph": True}, "cuda-graph"),
        ({"scene-field": "mlp", "mlp-samples": 0}, "mlp-samples"),
        ({"scene-field": "mlp", "mlp-importance": 1025}, "mlp-importance"),
        ({"scene-field": "nerf"}, "scene-field"),
        ({"mode": "split", "scene-field": "mlp"}, "scene-field"),
    ],
)
def test_keys_the_field_does_not_read_are_refused_by_name(settings: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"'{named}'"):
        strategies.parse_app_config(settings)


@pytest.mark.parametrize(
    "extreme",
    [
        {"field-width": 1, "field-depth": 1, "mlp-samples": 1, "mlp-importance": 0,
         "personal-width": 1},
        {"mlp-samples": 64, "mlp-importance": 64},
    ],
    ids=["smallest", "paper-samples"],
)  # fmt: skip
def test_decentnerf_with_the_paper_fields_runs_through_the_app(
    extreme: dict, crowd_dir: Path, tmp_path: Path
) -> None:
    """Two rounds of the App's scene job in process with the MLP fields (at the least values
    the parser takes, and at the paper's sample counts; the largest counts are work, as
    `test_setting_extremes.WORK_KEYS`): every reply summed, finite losses and scores, the global as
    the MLP's tensors; each node keeps its personal MLP and no occupancy grid."""
    from simulations.federated_nerf import run_federated_nerf
    from simulations.run import client_app

    nodes = tmp_path / "nodes"
    config = {**SCENE, **TINY_MLP, **extreme, "data-dir": str(crowd_dir),
              "state-dir": str(nodes), "run-dir": str(tmp_path / "run")}  # fmt: skip
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    run_dir = run_federated_nerf(grid, strategies.parse_app_config(config))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["num-replies"] for line in lines] == [3, 3]
    assert all(math.isfinite(line["train-loss"]) for line in lines)
    final = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert final["field"]["kind"] == "nerf"
    states = sorted(path for path in nodes.rglob("*") if path.is_file())
    names = " ".join(path.name for path in states)
    assert "personal-field" in names and "occupancy" not in names, names


def test_a_personal_mlp_s_huge_density_stays_finite_through_the_nerfw_loss() -> None:
    """DecentNeRF's personal MLP drove its density pre-activation past exp's float32 range
    (88.7) within 72 central steps: the density became inf, transmittance inf - inf = NaN,
    and the run diverged. The density is capped at exp(60): opaque, finite, differentiable."""
    config = strategies.parse_app_config(TINY_MLP)
    settings = render_config(config, None)
    personal = PersonalField(personal_field_config(config, settings, num_images=2))
    with torch.no_grad():
        personal.density_head[-1].bias[0] = 500.0  # exp(500 - 4) overflows float32
    field = GlobalPersonalField(global_field(config), personal)
    rays = Rays(torch.tensor([[0.0, 0.0, 4.0]] * 4), torch.tensor([[0.0, 0.0, -1.0]] * 4))
    rendered, _ = render_rays(field, rays, settings, image_index=torch.tensor([0, 1, 0, 1]))
    assert rendered.personal_density.max().item() == pytest.approx(math.exp(60.0), rel=1e-5)
    loss = nerfw_loss(rendered.rgb, torch.zeros(4, 3), rendered.uncertainty,
                      rendered.personal_density, beta_min=0.03).total  # fmt: skip
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in field.parameters() if p.grad is not None)
    assert torch.equal(trunc_exp(torch.tensor([59.5, -3.0])), torch.exp(torch.tensor([59.5, -3.0])))
