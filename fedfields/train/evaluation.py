"""Score a field on views of a scene and write its renders next to the ground truth."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from fedfields.data.scene import Scene
from fedfields.fields import Field
from fedfields.metrics import lpips, psnr, ssim
from fedfields.render import OccupancyGrid, RenderConfig, RenderOutputs, render_image


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
        Image.fromarray(strip).save(path)
        written.append(path)
    return written
