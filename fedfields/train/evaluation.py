"""Score a field on views of a scene and write its renders next to the ground truth; render
the run-config's federated global field from its parameters (`FieldRenderer`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data.scene import Scene
from fedfields.devices import resolve_device
from fedfields.fields import Field, HashGridField
from fedfields.metrics import lpips, psnr, ssim
from fedfields.render import OccupancyGrid, RenderConfig, RenderOutputs, render_image
from fedfields.render.orbit import ORBIT_FRAMES, orbit_path, render_orbit
from fedfields.train.builders import global_field, render_config, server_device
from fedfields.train.checkpoint import load_checkpoint
from fedfields.train.federated import load_federated_state

OCCUPANCY_PASSES = 2  # grid refreshes from a freshly loaded field before rendering
OCCUPANCY_SEED = 0  # the refreshes' points: a field scores the same whatever ran before it


@dataclass
class Evaluation:
    """Mean metrics over the evaluated views (lpips None when unavailable) and the renders."""

    psnr: float
    ssim: float
    lpips: float | None
    per_view_psnr: list[float]
    renders: list[RenderOutputs]

    def summary(self) -> dict[str, float | None]:
        return {"psnr": self.psnr, "ssim": self.ssim, "lpips": self.lpips}


def evaluate(
    field: Field,
    scene: Scene,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None = None,
    progress: bool = True,
) -> Evaluation:
    """Render every view of `scene` and compare with its images (PSNR, SSIM, LPIPS)."""
    field.eval()
    scene_on_device = scene.to(field.device)
    if occupancy is not None:
        occupancy.to(field.device)
    renders = [
        _to_cpu(render_image(field, scene_on_device.cameras, view, render_config, occupancy))
        for view in tqdm(range(len(scene)), desc="render", disable=not progress, leave=False)
    ]
    predictions = torch.stack([r.rgb.clamp(0.0, 1.0) for r in renders])
    per_view = [psnr(p, t) for p, t in zip(predictions, scene.images, strict=True)]
    perceptual = lpips(predictions, scene.images)
    return Evaluation(
        psnr=float(np.mean(per_view)),
        ssim=ssim(predictions, scene.images),
        lpips=perceptual,
        per_view_psnr=per_view,
        renders=renders,
    )


def _to_cpu(render: RenderOutputs) -> RenderOutputs:
    return RenderOutputs(
        rgb=render.rgb.cpu(), depth=render.depth.cpu(), opacity=render.opacity.cpu()
    )


def depth_image(render: RenderOutputs, near: float, far: float) -> np.ndarray:
    """Colour-mapped depth (turbo) in [near, far], faded to white where the ray hit nothing."""
    import matplotlib  # on first use: a node's process renders no depth on most messages

    depth = render.depth / render.opacity.clamp_min(1e-6)
    normalised = ((depth - near) / (far - near)).clamp(0.0, 1.0).numpy()
    colored = matplotlib.colormaps["turbo"](normalised)[..., :3]
    opacity = render.opacity.clamp(0.0, 1.0).numpy()[..., None]
    return colored * opacity + (1.0 - opacity)


def write_renders(
    out_dir: str | Path, scene: Scene, evaluation: Evaluation, render_config: RenderConfig
) -> list[Path]:
    """Write one PNG per view: ground truth | render | depth, side by side."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for view, render in enumerate(evaluation.renders):
        panels = [
            scene.images[view].numpy(),
            render.rgb.clamp(0.0, 1.0).numpy(),
            depth_image(render, render_config.near, render_config.far),
        ]
        strip = (np.concatenate(panels, axis=1) * 255.0 + 0.5).astype(np.uint8)
        path = out_dir / f"{scene.image_paths[view].stem}.png"
        atomic.save_image(path, Image.fromarray(strip))
        written.append(path)
    return written


class FieldRenderer:
    """The run-config's global field with an occupancy grid (none for the MLP field, which
    samples every ray densely), rendering any view of any scene.

    The server's report, the simulation's observers and `fedfields audit` score the same
    field the same way: loaded from federated parameters (`load`, fresh grid) or from a run's
    checkpoint (`from_checkpoint`, the grid saved with it). Field and grid live on `device`,
    by default run-config `server-device`; renders come back on the CPU.
    """

    def __init__(self, config: FederatedConfig, device: str | torch.device | None = None) -> None:
        self.config = config
        self.device = server_device(config) if device is None else resolve_device(device)
        self.field = global_field(config).to(self.device)
        self.occupancy = self._fresh_grid()

    @classmethod
    def from_checkpoint(
        cls, config: FederatedConfig, path: Path, device: str | torch.device | None = None
    ) -> FieldRenderer:
        """The field and occupancy grid a run saved in `path` (`save_checkpoint`)."""
        renderer = cls(config, device)
        field, _, occupancy, _ = load_checkpoint(path)
        renderer.field = field.to(renderer.device).eval()
        renderer.occupancy = occupancy.to(renderer.device) if occupancy is not None else None
        return renderer

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load federated parameters and refresh the occupancy grid from their density, with
        its own seeded points: the same parameters give the same grid and scores whatever
        consumed the global RNG before (e.g. the order in which uploads are scored)."""
        load_federated_state(self.field, state)
        self.field.eval()
        self.occupancy = self._fresh_grid()
        if self.occupancy is None:
            return
        step = render_config(self.config, None).step_size
        points = torch.Generator(device=self.device).manual_seed(OCCUPANCY_SEED)
        for _ in range(OCCUPANCY_PASSES):
            self.occupancy.update(self.field.density, step, generator=points)

    def _fresh_grid(self) -> OccupancyGrid | None:
        """An occupancy grid over the hash-grid field's box (all cells set), None for the MLP."""
        return OccupancyGrid(self.field.aabb) if isinstance(self.field, HashGridField) else None

    def __call__(self, scene: Scene, view: int) -> torch.Tensor:
        """The field's [H, W, 3] render of `scene`'s view `view`, clamped to [0, 1]."""
        settings = render_config(self.config, scene)
        rendered = render_image(self.field, scene.cameras, view, settings, self.occupancy)
        return rendered.rgb.clamp(0.0, 1.0).cpu()

    def orbit(self, frames: int = ORBIT_FRAMES) -> list[np.ndarray]:
        """`frames` frames of the field orbiting the scene box (the server has no user's
        cameras)."""
        settings = render_config(self.config, None)
        return render_orbit(self.field, settings, self.occupancy, orbit_path(settings, frames))

    def score_scene(self, scene: Scene, views: range, perceptual: bool = False) -> dict[str, float]:
        """Mean "psnr" and "ssim" of the renders of `views` against `scene`'s images, and with
        `perceptual` their "lpips" (left out where LPIPS is unavailable: it warns once)."""
        renders = torch.stack([self(scene, view) for view in views])
        targets = scene.images[list(views)]
        values = [psnr(r, t) for r, t in zip(renders, targets, strict=True)]
        scores = {"psnr": float(np.mean(values)), "ssim": ssim(renders, targets)}
        perceptual_distance = lpips(renders, targets) if perceptual else None
        if perceptual_distance is not None:
            scores["lpips"] = perceptual_distance
        return scores
