"""A looping orbit animation of a field: what a reader of a run's report looks at first.

The server holds no user's cameras, so the path is made from the render settings alone: a
circle around the box centre at the middle of the near/far range, looking slightly down, with
the NeRF-synthetic field of view. Frames are written as one looping GIF (imageio).
"""

from __future__ import annotations

import io
import math
from dataclasses import replace
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import torch

from fedfields import atomic
from fedfields.fields.base import Field
from fedfields.geometry.cameras import CAMERA_ANGLE_X, Cameras, look_at
from fedfields.render.occupancy import OccupancyGrid
from fedfields.render.renderer import RenderConfig, render_image

ORBIT_FILE = "orbit.gif"  # in a scene run's directory; report.html embeds it
ORBIT_FRAMES = 16
ORBIT_SIZE = 64  # pixels per side: a server-side render must stay cheap on a CPU
ORBIT_STEP_FACTOR = 4.0  # marching steps this many times the training step: a preview
ORBIT_ELEVATION = 30.0  # degrees above the horizon, as the NeRF-synthetic test orbits
FRAME_SECONDS = 0.12


def orbit_path(
    config: RenderConfig,
    frames: int = ORBIT_FRAMES,
    size: int = ORBIT_SIZE,
    elevation_degrees: float = ORBIT_ELEVATION,
) -> Cameras:
    """`frames` cameras evenly around the box centre (z up), `size` x `size` pixels each."""
    if frames < 1 or size < 1:
        raise ValueError(f"an orbit needs frames >= 1 and size >= 1, got {frames} and {size}")
    box = config.aabb_tensor
    centre = 0.5 * (box[0] + box[1])
    radius = 0.5 * (config.near + config.far)
    elevation = math.radians(elevation_degrees)
    poses = []
    for frame in range(frames):
        azimuth = 2.0 * math.pi * frame / frames
        offset = torch.tensor(
            [
                math.cos(elevation) * math.cos(azimuth),
                math.cos(elevation) * math.sin(azimuth),
                math.sin(elevation),
            ]
        )
        poses.append(look_at(centre + radius * offset, centre))
    focal = 0.5 * size / math.tan(0.5 * CAMERA_ANGLE_X)
    filled = torch.full((frames,), float(focal))
    half = torch.full((frames,), 0.5 * size)
    return Cameras(torch.stack(poses), filled, filled.clone(), half, half.clone(), size, size)


@torch.no_grad()
def render_orbit(
    field: Field,
    config: RenderConfig,
    occupancy: OccupancyGrid | None = None,
    cameras: Cameras | None = None,
) -> list[np.ndarray]:
    """The field's colour along `cameras` (default: `orbit_path(config)`) as uint8 frames,
    rendered on the field's device with `ORBIT_STEP_FACTOR` times coarser marching steps, or
    as many times fewer dense samples per ray (an untrained 16-level field took 73 s for 24
    frames at 96 px on one CPU thread at the training step; this is a preview, not a score)."""
    cameras = orbit_path(config) if cameras is None else cameras
    config = replace(
        config,
        step_size=config.step_size * ORBIT_STEP_FACTOR,
        num_samples=max(1, round(config.num_samples / ORBIT_STEP_FACTOR)),
        num_importance=round(config.num_importance / ORBIT_STEP_FACTOR),
    )
    cameras = cameras.to(field.device)
    frames = []
    for view in range(len(cameras)):
        rgb = render_image(field, cameras, view, config, occupancy).rgb
        frames.append((rgb.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).cpu().numpy())
    return frames


def write_gif(
    path: Path, frames: list[np.ndarray], seconds_per_frame: float = FRAME_SECONDS
) -> Path:
    """`frames` as a looping GIF at `path`, written atomically."""
    buffer = io.BytesIO()
    iio.imwrite(
        buffer, np.stack(frames), extension=".gif", duration=seconds_per_frame * 1000, loop=0
    )
    atomic.write_bytes(path, buffer.getvalue())
    return path
