"""Building a crowd: a scene's views partitioned among users and their persons composited."""

from __future__ import annotations

from pathlib import Path

from fedfields.data.crowd.config import CrowdConfig
from fedfields.data.crowd.front import build_front
from fedfields.data.crowd.novel_blender import build_novel_blender
from fedfields.data.crowd.partition import check_view_count
from fedfields.data.crowd.records import Crowd
from fedfields.data.scene import Scene, load_scene


def build_crowd(scene: Scene, config: CrowdConfig, progress: bool = True) -> Crowd:
    """Partition the views among users and composite their persons (`config.layout`).

    `scene` must be loaded on a black background so its images are alpha-premultiplied.
    """
    if any(value != 0.0 for value in scene.background):
        raise ValueError("build_crowd needs the scene loaded with background=(0, 0, 0)")
    check_view_count(scene, config)
    if config.layout == "front":
        return build_front(scene, config, progress)
    return build_novel_blender(scene, config, progress)


def crowd_from_scene_dir(
    scene_dir: str | Path, config: CrowdConfig, downscale: float = 1.0, progress: bool = True
) -> Crowd:
    """Load a scene on black (premultiplied) and build its crowd."""
    scene = load_scene(scene_dir, downscale=downscale, background=(0.0, 0.0, 0.0))
    return build_crowd(scene, config, progress=progress)
