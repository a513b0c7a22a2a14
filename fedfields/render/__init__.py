"""Samplers, occupancy grids and volume rendering for any Field."""

from fedfields.render.occupancy import OccupancyGrid, PackedSamples
from fedfields.render.renderer import RenderConfig, render_image, render_rays
from fedfields.render.volume import RenderOutputs

__all__ = [
    "OccupancyGrid",
    "PackedSamples",
    "RenderConfig",
    "RenderOutputs",
    "render_image",
    "render_rays",
]
