"""Which user holds which views: the configured partitioner over the scene's cameras."""

from __future__ import annotations

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
    """Split the scene's views among users with the configured partitioner."""
    check_view_count(scene, config)
    directions = viewing_directions(scene.cameras.camera_to_world.numpy(), sphere.centre)
    if config.partition == "directions":
        return direction_clusters(directions, config.users, config.views_per_user, config.seed)
    if config.partition == "yaw":
        return yaw_sectors(directions, config.users, config.views_per_user, config.seed)
    return random_partition(len(scene), config.users, config.views_per_user, config.seed)


def check_view_count(scene: Scene, config: CrowdConfig) -> None:
    """Refuse early when the users need more views than the scene has."""
    needed = config.users * config.views_per_user
    if needed > len(scene):
        raise CrowdError(
            f"{config.users} users x {config.views_per_user} views needs {needed} views, "
            f"the scene has {len(scene)}"
        )
