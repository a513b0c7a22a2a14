"""Training pixels of a scene: uniformly random or chosen pixels with their rays and colours."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.data.scene import Scene
from fedfields.geometry.rays import Rays, pixel_rays


@dataclass
class PixelBatch:
    """Training pixels: their rays, target colours and the background they assume."""

    rays: Rays
    colors: Tensor  # [R, 3]
    background: Tensor  # [3] or [R, 3]
    image_index: Tensor  # [R] int64: each pixel's view (for per-image appearance embeddings)


class PixelSampler:
    """Uniformly random training pixels of a scene, with their rays and colours.

    With `random_background`, each pixel's transparent part is re-composited on a random
    colour that the renderer also uses, so the field cannot explain the background with
    matter (as nerfacc trains the Blender scenes).
    """

    def __init__(self, scene: Scene, random_background: bool) -> None:
        self.cameras = scene.cameras
        self.colors = scene.images.reshape(-1, 3)
        self.transparency = 1.0 - scene.masks.reshape(-1)
        self.background = self.colors.new_tensor(scene.background)
        self.random_background = random_background and bool((self.transparency > 0).any())

    def refill(self, scene: Scene) -> None:
        """Another scene of the same size in place: a captured step reads these tensors.
        Its background and whether it is recomposited must be this sampler's."""
        self.colors.copy_(scene.images.reshape(-1, 3))
        self.transparency.copy_(1.0 - scene.masks.reshape(-1))
        self.background.copy_(self.colors.new_tensor(scene.background))
        for name in ("camera_to_world", "fx", "fy", "cx", "cy"):
            getattr(self.cameras, name).copy_(getattr(scene.cameras, name))

    def sample(self, count: int) -> PixelBatch:
        """`count` uniformly random pixels of all views."""
        flat = torch.randint(0, self.num_pixels, (count,), device=self.colors.device)
        return self.pixels(flat)

    @property
    def num_pixels(self) -> int:
        """Pixels of all views."""
        return self.colors.shape[0]

    def rays(self, flat: Tensor) -> Rays:
        """The rays through pixels at flat indices (view-major, then row, then column); no
        random draw."""
        return pixel_rays(self.cameras, *self._view_row_column(flat))

    def pixels(self, flat: Tensor) -> PixelBatch:
        """Pixels at flat indices (view-major, then row, then column)."""
        view, row, column = self._view_row_column(flat)
        rays = pixel_rays(self.cameras, view, row, column)
        if not self.random_background:
            return PixelBatch(rays, self.colors[flat], self.background, view)
        background = torch.rand(len(flat), 3, device=self.colors.device)
        shift = self.transparency[flat, None] * (background - self.background)
        return PixelBatch(rays, self.colors[flat] + shift, background, view)

    def _view_row_column(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        pixels_per_view = self.cameras.height * self.cameras.width
        view, within = flat // pixels_per_view, flat % pixels_per_view
        return view, within // self.cameras.width, within % self.cameras.width
