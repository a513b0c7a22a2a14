"""How a crowd is drawn: layouts, partitions, presets and the validated CrowdConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedfields.data.figures import TORSO_SPAN

PARTITIONS = ("directions", "yaw", "random")


LAYOUTS = ("novel-blender", "front")


DEFAULT_PARTITION = {"novel-blender": "yaw", "front": "directions"}


# Fig. 4 of DecentNeRF: 8 users whose views overlap (random split), half heavily occluded.
PRESETS: dict[str, dict[str, Any]] = {
    "novel-blender": {},
    "heterogeneous": {
        "users": 8,
        "views_per_user": 10,
        "partition": "random",
        "heterogeneous": True,
    },
}


ANCHOR_HEIGHT = sum(TORSO_SPAN) / 2  # inside every torso, as a fraction of the height


OBJECT_ALPHA = 0.5  # pixels with more scene alpha are the object (hull silhouettes, coverage)


class CrowdError(ValueError):
    """A crowd cannot be built as asked (too few views, no spot for a user's person)."""


@dataclass(frozen=True)
class CrowdConfig:
    """How a crowd is drawn: users, their views, their persons, and transient passers-by.

    layout "novel-blender" (DecentNeRF's benchmark): persons stand on the object's ground
    around it, one static per user plus `transients_per_view` passers-by in every view.
    layout "front": one person per user outside the scene's bounding sphere, toward its cameras.
    """

    users: int = 16
    views_per_user: int = 5
    layout: str = "novel-blender"
    partition: str | None = None  # None: the layout's default (DEFAULT_PARTITION)
    seed: int = 0
    person_height: float = 0.35  # front: as a fraction of the bounding sphere's radius
    # novel-blender: person height as a share of the object height above the ground (0.59 on lego)
    person_scale: float = 0.45
    spot_radius: float = 1.25  # novel-blender: feet within this distance of the object's centre
    transients_per_view: int = 5  # novel-blender: one-off passers-by in every view
    heterogeneous: bool = False  # novel-blender: half the users heavily, half lightly occluded
    heavy_scale: float = 1.35  # heavy users' persons are this much taller
    hull_resolution: int = 128  # novel-blender: voxels per axis of the hull that gives depth
    margin: float = 0.08  # front: the person keeps this fraction of the image size from edges
    min_person_pixels: int = 12  # at 100x100; scaled with the image area
    transient_probability: float = 0.0  # front: chance that a view also shows a passer-by
    heldout_views: int = 0  # clean views no user photographed, spread evenly: scored, never trained
    max_tries: int = 4000

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise CrowdError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.partition is None:
            object.__setattr__(self, "partition", DEFAULT_PARTITION[self.layout])
        if self.partition not in PARTITIONS:
            raise CrowdError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.users < 1 or self.views_per_user < 1:
            raise CrowdError(
                f"users ({self.users}) and views per user ({self.views_per_user}) must be >= 1"
            )
        if not 0.0 <= self.transient_probability <= 1.0:
            raise CrowdError(
                f"transient probability must be in [0, 1]: {self.transient_probability}"
            )
        if self.heldout_views < 0:
            raise CrowdError(f"heldout_views must be >= 0, got {self.heldout_views}")
        if self.transients_per_view < 0:
            raise CrowdError(f"transients_per_view must be >= 0, got {self.transients_per_view}")
        for key in ("person_scale", "spot_radius", "person_height"):
            if not getattr(self, key) > 0:
                raise CrowdError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.heavy_scale < 1.0:
            raise CrowdError(f"heavy_scale must be >= 1, got {self.heavy_scale}")
        if self.hull_resolution < 16:
            raise CrowdError(f"hull_resolution must be >= 16, got {self.hull_resolution}")
        if self.layout == "front" and self.heterogeneous:
            raise CrowdError("heterogeneous=True needs layout 'novel-blender', got 'front'")
        if self.layout == "novel-blender" and self.transient_probability > 0:
            raise CrowdError(
                f"transient_probability ({self.transient_probability}) is for layout 'front'; "
                "layout 'novel-blender' uses transients_per_view"
            )
        if self.heterogeneous and self.users < 2:
            raise CrowdError(f"heterogeneous needs users >= 2, got {self.users}")
