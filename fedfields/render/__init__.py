"""Rays, samplers, occupancy grids and volume rendering for any Field."""

from fedfields.render.occupancy import OccupancyGrid, PackedSamples
from fedfields.render.rays import Rays, image_rays, intersect_aabb, pixel_rays
from fedfields.render.renderer import RenderConfig, render_image, render_rays
from fedfields.render.volume import RenderOutputs

__all__ = [
    "OccupancyGrid",
    "PackedSamples",
    "Rays",
    "RenderConfig",
    "RenderOutputs",
    "image_rays",
    "intersect_aabb",
    "pixel_rays",
    "render_image",
    "render_rays",
]
