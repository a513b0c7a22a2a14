"""The orbit animation of a field (`fedfields.render.orbit`): the path circles the box centre and
looks at it, and the GIF a report embeds decodes to every frame and loops."""

from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from torch import Tensor

from fedfields.fields.base import Field, FieldOutputs
from fedfields.render import RenderConfig
from fedfields.render.orbit import ORBIT_FRAMES, orbit_path, render_orbit, write_gif
from strategies import parse_app_config


class Ball(Field):
    """A ball of radius 0.5 at `centre`, red on its +x half and green on the other: each
    side of the orbit sees other colours."""

    def __init__(self, centre: tuple[float, float, float]) -> None:
        super().__init__()
        self.register_buffer("centre", torch.tensor(centre))

    def density(self, points: Tensor) -> Tensor:
        return 50.0 * ((points - self.centre).norm(dim=-1) < 0.5).float()

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        red = (points[:, 0] > self.centre[0]).float()
        rgb = torch.stack([red, 1.0 - red, torch.zeros_like(red)], dim=-1)
        return FieldOutputs(density=self.density(points), rgb=rgb)


def test_the_path_circles_the_box_centre_at_mid_range_and_looks_at_it() -> None:
    config = RenderConfig(near=2.0, far=6.0, aabb=(0.0, 0.0, 0.0, 2.0, 2.0, 2.0))
    cameras = orbit_path(config, frames=8, size=16)
    positions = cameras.camera_to_world[:, :3, 3]
    centre = torch.ones(3)
    assert torch.allclose((positions - centre).norm(dim=-1), torch.full((8,), 4.0), atol=1e-5)
    forward = -cameras.camera_to_world[:, :3, 2]  # OpenGL cameras look down -z
    towards = torch.nn.functional.normalize(centre - positions, dim=-1)
    assert torch.allclose(forward, towards, atol=1e-5)
    assert len({tuple(p.round(decimals=4).tolist()) for p in positions}) == 8


def test_an_off_centre_ball_is_seen_in_the_middle_of_every_frame(tmp_path: Path) -> None:
    config = RenderConfig(
        near=2.0, far=6.0, aabb=(0.0, 0.0, 0.0, 2.0, 2.0, 2.0), num_samples=96, chunk=4096
    )
    frames = render_orbit(Ball((1.0, 1.0, 1.0)), config, cameras=orbit_path(config, 6, 24))
    assert len(frames) == 6 and all(f.shape == (24, 24, 3) and f.dtype == np.uint8 for f in frames)
    for frame in frames:
        assert frame[12, 12, 2] == 0 and frame[12, 12, :2].max() > 200  # the ball, in the middle
        assert frame[0, 0].tolist() == [255, 255, 255]  # the white background in the corner
    seen_from = [frame[12, 12].tolist() for frame in frames]
    assert [0, 255, 0] in seen_from and [255, 0, 0] in seen_from  # both halves come round
    path = write_gif(tmp_path / "orbit.gif", frames)
    decoded = iio.imread(path, index=None)
    assert decoded.shape[:3] == (6, 24, 24)
    assert iio.immeta(path).get("loop") == 0  # loops for ever
    assert not list(tmp_path.glob(".*partial"))


def test_a_path_without_frames_is_refused() -> None:
    with pytest.raises(ValueError, match="frames >= 1"):
        orbit_path(RenderConfig(), frames=0)


def test_the_run_config_s_orbit_frames_default_is_the_orbit_s_and_its_bounds_are_named() -> None:
    """run-config orbit-frames (0: no orbit) defaults to the orbit module's frame count."""
    assert parse_app_config({}).scene.orbit_frames == ORBIT_FRAMES
    assert parse_app_config({"orbit-frames": 0}).scene.orbit_frames == 0
    for bad in (-1, 361):
        with pytest.raises(ValueError, match="'orbit-frames'"):
            parse_app_config({"orbit-frames": bad})
