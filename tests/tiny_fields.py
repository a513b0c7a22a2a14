"""The hash-grid setup of `default_setup`, shrunk for CPU tests of step mechanics.

Tests of what a training step does (host reads, workspaces, captures, replays) need the real
field, renderer and occupancy grid, not their full size: a 2^12-row, 8-level table and a 32^3
grid keep every code path while costing a fraction of the 2^17 x 16 default on two cores.
"""

from __future__ import annotations

from dataclasses import replace

from fedfields.data.scene import Scene
from fedfields.fields import HashGridField
from fedfields.render import OccupancyGrid
from fedfields.train.centralised import Setup, default_setup

TINY_LOG2_HASHMAP_SIZE = 12
TINY_LEVELS = 8
TINY_GRID_RESOLUTION = 32


def tiny_hashgrid_setup(scene: Scene) -> Setup:
    """`default_setup("hashgrid", scene, "torch")` with a small table, fewer levels and a
    coarser occupancy grid; render and optimiser defaults unchanged."""
    setup = default_setup("hashgrid", scene, implementation="torch")
    config = setup.field.config
    encoding = replace(
        config.encoding, log2_hashmap_size=TINY_LOG2_HASHMAP_SIZE, num_levels=TINY_LEVELS
    )
    return replace(
        setup,
        field=HashGridField(replace(config, encoding=encoding)),
        occupancy=OccupancyGrid(scene.aabb, resolution=TINY_GRID_RESOLUTION),
    )


def tiny_grid(field: HashGridField) -> OccupancyGrid:
    """An occupancy grid over `field`'s box at the tiny resolution."""
    return OccupancyGrid(field.aabb, resolution=TINY_GRID_RESOLUTION)
