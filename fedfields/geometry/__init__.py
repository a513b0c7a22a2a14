"""Cameras and rays, below both render and data: pinhole poses, rigs, projection, pixel rays."""

from fedfields.geometry.cameras import CAMERA_ANGLE_X, Cameras, look_at, orbit_cameras, project
from fedfields.geometry.rays import Rays, image_rays, intersect_aabb, pixel_rays

__all__ = [
    "CAMERA_ANGLE_X",
    "Cameras",
    "Rays",
    "image_rays",
    "intersect_aabb",
    "look_at",
    "orbit_cameras",
    "pixel_rays",
    "project",
]
