"""Which user holds which views: the configured partitioner over the scene's cameras."""

from __future__ import annotations

from dataclasses import replace

from fedfields.data.crowd.config import CrowdConfig, CrowdError
from fedfields.data.crowd.geometry import BoundingSphere
from fedfields.data.partition import (
    Partition,
    direction_clusters,
    random_partition,
    viewing_directions,
    yaw_sectors,
)
from fedfields.data.scene import Scene


def partition_views(scene: Scene, sphere: BoundingSphere, config: CrowdConfig) -> Partition:
    """Split the scene's views among users with the configured partitioner, after setting
    `config.heldout_views` aside (`heldout_views`): poses no user photographed, in
    `left_out` with any view the partitioner leaves."""
    check_view_count(scene, config)
    kept = heldout_views(len(scene), config.heldout_views)
    photographed = [view for view in range(len(scene)) if view not in set(kept)]
    poses = scene.cameras.camera_to_world.numpy()[photographed]
    directions = viewing_directions(poses, sphere.centre)
    if config.partition == "directions":
        drawn = direction_clusters(directions, config.users, config.views_per_user, config.seed)
    elif config.partition == "yaw":
        drawn = yaw_sectors(directions, config.users, config.views_per_user, config.seed)
    else:
        drawn = random_partition(
            len(photographed), config.users, config.views_per_user, config.seed
        )
    if not kept:
        return drawn
    groups = tuple(tuple(photographed[i] for i in group) for group in drawn.groups)
    left_out = tuple(sorted({*kept, *(photographed[i] for i in drawn.left_out)}))
    return replace(drawn, groups=groups, left_out=left_out)


def heldout_views(num_views: int, count: int) -> tuple[int, ...]:
    """`count` views spread evenly over the scene's order (for NeRF-synthetic scenes an
    orbit, so spread around the object): index round(i * num_views / count) for i < count."""
    return tuple(sorted({round(i * num_views / count) for i in range(count)})) if count else ()


def check_view_count(scene: Scene, config: CrowdConfig) -> None:
    """Refuse early when the users and the held-out views need more views than the scene has."""
    needed = config.users * config.views_per_user + config.heldout_views
    if needed > len(scene):
        kept = f" + {config.heldout_views} held out" if config.heldout_views else ""
        raise CrowdError(
            f"{config.users} users x {config.views_per_user} views{kept} needs {needed} "
            f"views, the scene has {len(scene)}"
        )
