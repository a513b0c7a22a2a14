"""Crowdsourced scenes: a real scene's views split among users, each photographing their own person.

DecentNeRF's "Novel Blender" benchmark in our words: every user holds a few views from nearby
directions, and a static person (personal content) stands in all of them at one fixed 3D spot
between that user's cameras and the scene, so compositing it over the real image is physically
correct. Persons are ray-cast surfaces (`fedfields.data.surfaces`), never volume renders, and
come with exact per-pixel masks, so leakage of personal content can be measured.

One module per job: `config` (what to draw), `geometry` (hull, sphere, ground, depth),
`partition` (views per user), `front` and `novel_blender` (the two layouts), `compositing`,
`build`, `writer`, `contact_sheet`, `reader`.
"""

from fedfields.data.crowd.build import build_crowd, crowd_from_scene_dir
from fedfields.data.crowd.compositing import composite_persons, written_change
from fedfields.data.crowd.config import (
    DEFAULT_PARTITION,
    LAYOUTS,
    PARTITIONS,
    PRESETS,
    CrowdConfig,
    CrowdError,
)
from fedfields.data.crowd.contact_sheet import contact_sheet
from fedfields.data.crowd.geometry import (
    BoundingSphere,
    Ground,
    bounding_sphere,
    ground_of,
    hull_depth,
    silhouette_hull,
    visual_hull,
)
from fedfields.data.crowd.partition import partition_views
from fedfields.data.crowd.reader import CrowdData, CrowdUser, load_crowd_user
from fedfields.data.crowd.records import Crowd, PersonSpec, UserViews
from fedfields.data.crowd.writer import CROWD_FORMAT, write_crowd

__all__ = [
    "CROWD_FORMAT",
    "DEFAULT_PARTITION",
    "LAYOUTS",
    "PARTITIONS",
    "PRESETS",
    "BoundingSphere",
    "Crowd",
    "CrowdConfig",
    "CrowdData",
    "CrowdError",
    "CrowdUser",
    "Ground",
    "PersonSpec",
    "UserViews",
    "bounding_sphere",
    "build_crowd",
    "composite_persons",
    "contact_sheet",
    "crowd_from_scene_dir",
    "ground_of",
    "hull_depth",
    "load_crowd_user",
    "partition_views",
    "silhouette_hull",
    "visual_hull",
    "write_crowd",
    "written_change",
]
