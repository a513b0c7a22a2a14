"""The training steps read nothing back from the device each step (issue 34, point 2).

A host read (`.item()`, `.tolist()`, `float(t)`, `bool(t)`) stalls a GPU's stream until every
queued kernel finished. On CPU nothing stalls, so the reads fedfields' own code makes are
counted instead; marching's sample count (a nonzero) is the one sync left and is not counted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedfields.data import holdout_indices, load_scene
from fedfields.data.scene import Scene
from fedfields.fields.base import FieldOutputs
from fedfields.geometry.rays import Rays, intersect_aabb
from fedfields.render import OccupancyGrid, RenderConfig
from fedfields.train.centralised import default_setup, train
from fedfields.train.federated import LocalTrainConfig, local_train

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
PACKAGE = str(Path(__file__).resolve().parents[1] / "fedfields")


@pytest.fixture(scope="module")
def tiny_lego() -> Scene:
    scene = load_scene(LEGO, downscale=8)
    return scene.subset(holdout_indices(len(scene), 8)[0])


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every tensor-to-host read made from a fedfields module, as 'file:line'."""
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                reads.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield reads


def _reads_of(run, steps: int, reads: list[str]) -> list[str]:
    """The host reads `run(steps)` makes, setup included."""
    reads.clear()
    run(steps)
    return list(reads)


def test_centralised_hashgrid_steps_read_the_device_only_at_log_and_grid_steps(
    tiny_lego: Scene, host_reads: list[str]
) -> None:
    def run(steps: int) -> None:
        setup = default_setup("hashgrid", tiny_lego, implementation="torch")
        config = setup.train_config(
            steps=steps, target_samples=1 << 12, progress=False, log_every=24, device="cpu"
        )
        train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)

    short, long = _reads_of(run, 24, host_reads), _reads_of(run, 72, host_reads)
    # 48 more steps: 2 loss checks at log steps + 3 grid refreshes (every 16 steps); a read
    # per step (the loss, the march's step count) would add 48 or more
    assert len(long) - len(short) <= 5, long


def test_local_round_reads_the_device_every_sixteen_steps(
    tiny_lego: Scene, host_reads: list[str]
) -> None:
    def run(steps: int) -> None:
        setup = default_setup("hashgrid", tiny_lego, implementation="torch")
        config = LocalTrainConfig(steps=steps, target_samples=1 << 12, device="cpu")
        local_train(setup.field, tiny_lego, config, setup.render_config, setup.occupancy)

    short, long = _reads_of(run, 16, host_reads), _reads_of(run, 64, host_reads)
    # 48 more steps: 3 loss checks + 3 grid refreshes
    assert len(long) - len(short) <= 6, long


class _TurnsNaN(torch.nn.Module):
    """A field that renders fine for `good_calls` forwards, then NaN density."""

    def __init__(self, good_calls: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.calls, self.good_calls = 0, good_calls

    def density(self, points: torch.Tensor) -> torch.Tensor:
        bad = self.calls > self.good_calls
        return self.scale * torch.full_like(points[:, 0], float("nan") if bad else 1.0)

    def forward(
        self, points: torch.Tensor, directions: torch.Tensor, image_index: object = None
    ) -> FieldOutputs:
        self.calls += 1
        return FieldOutputs(self.density(points), torch.sigmoid(points) * self.scale)


def test_a_loss_checked_late_still_names_the_first_bad_step(tiny_lego: Scene) -> None:
    setup = default_setup("nerf", tiny_lego)
    render = replace(setup.render_config, num_samples=4, num_importance=0)
    config = setup.train_config(steps=20, progress=False, batch_rays=16, log_every=10)
    with pytest.raises(FloatingPointError, match="training diverged at step 7: loss is nan"):
        train(_TurnsNaN(good_calls=7), tiny_lego, config, render)


def test_local_training_names_the_first_bad_step_between_checks(tiny_lego: Scene) -> None:
    render = replace(default_setup("nerf", tiny_lego).render_config, num_samples=4)
    config = LocalTrainConfig(steps=40, batch_rays=16, device="cpu")
    with pytest.raises(FloatingPointError, match="local training diverged at step 21:"):
        local_train(_TurnsNaN(good_calls=21), tiny_lego, config, render, None)


def _box_grid() -> OccupancyGrid:
    grid = OccupancyGrid(torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]), resolution=8)
    generator = torch.Generator().manual_seed(1)
    grid.occupied = torch.rand((8, 8, 8), generator=generator) > 0.5
    return grid


def _rays(num: int, seed: int, spread: float) -> Rays:
    generator = torch.Generator().manual_seed(seed)
    origins = torch.nn.functional.normalize(torch.randn(num, 3, generator=generator), dim=-1) * 3
    targets = (torch.rand(num, 3, generator=generator) - 0.5) * spread
    return Rays(origins, torch.nn.functional.normalize(targets - origins, dim=-1))


@pytest.mark.parametrize("spread", [1.0, 6.0])  # 6: many rays miss the box
def test_march_with_a_static_step_bound_keeps_the_same_samples(spread: float) -> None:
    grid = _box_grid()
    rays = _rays(300, seed=2, spread=spread)
    config = RenderConfig(near=0.5, far=5.0, aabb=(-1.0, -1.0, -1.0, 1.0, 1.0, 1.0))
    t_near, t_far = intersect_aabb(rays, config.aabb_tensor, config.near, config.far)
    step = 0.013
    read = grid.march(rays, t_near, t_far, step, perturb=False)
    bound = grid.march(rays, t_near, t_far, step, perturb=False, max_length=config.max_ray_length)
    assert read.t_mid.numel() > 100
    assert torch.equal(read.ray_index, bound.ray_index)
    assert torch.equal(read.t_mid, bound.t_mid)
    torch.manual_seed(5)
    read = grid.march(rays, t_near, t_far, step, perturb=True)
    torch.manual_seed(5)
    bound = grid.march(rays, t_near, t_far, step, perturb=True, max_length=config.max_ray_length)
    assert torch.equal(read.ray_index, bound.ray_index)
    assert torch.equal(read.t_mid, bound.t_mid)


def test_max_ray_length_bounds_every_interval_in_the_box() -> None:
    config = RenderConfig(near=0.0, far=100.0, aabb=(-1.0, -2.0, -1.0, 1.0, 2.0, 1.0))
    rays = _rays(5000, seed=3, spread=4.0)
    t_near, t_far = intersect_aabb(rays, config.aabb_tensor, config.near, config.far)
    longest = (t_far - t_near).max().item()
    assert config.max_ray_length == pytest.approx(24**0.5)
    assert 0.9 * config.max_ray_length < longest <= config.max_ray_length + 1e-5
