"""What a built crowd holds: each person's spec, each user's views, the crowd itself."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedfields.data.crowd.config import ANCHOR_HEIGHT, OBJECT_ALPHA
from fedfields.data.crowd.geometry import BoundingSphere, Ground
from fedfields.data.figures import person, place
from fedfields.data.partition import Partition
from fedfields.data.scene import Scene
from fedfields.data.surfaces import SurfaceObject
from fedfields.geometry.cameras import Cameras


@dataclass(frozen=True)
class PersonSpec:
    """Everything needed to rebuild a person exactly: its random draw and where it stands."""

    seed: int
    height: float
    feet: tuple[float, float, float]
    yaw: float

    def build(self) -> SurfaceObject:
        """The placed person as ray-castable surfaces."""
        figure = person(np.random.default_rng(self.seed), height=self.height)
        return place(figure, torch.tensor(self.feet, dtype=torch.float32), self.yaw)

    @property
    def anchor(self) -> tuple[float, float, float]:
        """The point inside the person's torso on its vertical axis: where it 'is' in 3D.

        `figures.TORSO_SPAN` guarantees the torso covers this height in every draw.
        """
        return (self.feet[0], self.feet[1], self.feet[2] + ANCHOR_HEIGHT * self.height)


@dataclass
class UserViews:
    """One user's views: composited images with their persons, masks, and the clean views."""

    user: int
    views: tuple[int, ...]  # indices into the source scene
    person: PersonSpec  # the static person: the user's personal content
    rgba: Tensor  # [V, H, W, 4] composited, straight alpha
    clean_rgba: Tensor  # [V, H, W, 4] the source views
    masks: Tensor  # [V, H, W] bool, every changed pixel (static person and passers-by)
    transients: tuple[tuple[PersonSpec, ...], ...]  # per view, its passers-by
    personal_masks: Tensor  # [V, H, W] bool, the static person's pixels
    transient_masks: Tensor  # [V, H, W] bool, the passers-by's pixels
    occlusion: str = "uniform"  # "heavy" or "light" in a heterogeneous crowd

    def coverage(self, position: int | None = None) -> dict[str, float]:
        """Fractions of object pixels (scene alpha > 0.5) that persons hide: all views or one."""
        chosen = slice(None) if position is None else slice(position, position + 1)
        scene = self.clean_rgba[chosen, ..., 3] > OBJECT_ALPHA
        total = max(int(scene.sum()), 1)
        return {
            name: int((mask[chosen] & scene).sum()) / total
            for name, mask in (
                ("static", self.personal_masks),
                ("transient", self.transient_masks),
                ("total", self.masks),
            )
        }


@dataclass
class Crowd:
    """A crowd built from one scene: its users, partition, and where persons were placed."""

    users: list[UserViews]
    partition: Partition
    sphere: BoundingSphere
    cameras: Cameras
    scene: Scene
    layout: str = "front"
    ground: Ground | None = None  # novel-blender only
