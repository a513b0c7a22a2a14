"""Reading a written crowd back: one user's views, masks and clean views, or all users."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from fedfields.data.scene import Scene, SceneError, load_scene
from fedfields.geometry.cameras import Cameras


@dataclass
class CrowdUser:
    """One user's dataset read back: the scene with personal content, its masks and clean views."""

    scene: Scene  # composited images (what the user photographed)
    personal_masks: Tensor  # [V, H, W] bool, the user's static person: where leakage is measured
    clean_images: Tensor  # [V, H, W, 3] composited on the scene's background
    person: dict[str, Any]
    transient_masks: Tensor  # [V, H, W] bool, passers-by (none in datasets without the key)


def load_crowd_user(
    folder: str | Path,
    downscale: float = 1.0,
    background: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> CrowdUser:
    """Read `user_NN/` written by `write_crowd`: images, static and transient masks, clean views.

    Datasets written before personal_masks/ existed give their masks/ as the personal masks.
    """
    folder = Path(folder)
    scene = load_scene(folder, downscale=downscale, background=background)
    meta = json.loads((folder / "transforms.json").read_text())
    masks, passers_by, clean = [], [], []
    for index, frame in enumerate(meta["frames"]):
        for key in ("mask_path", "clean_path"):
            if key not in frame or not (folder / frame[key]).is_file():
                raise SceneError(
                    f"{folder / 'transforms.json'}: frame {index} has no readable '{key}'"
                )
        personal = folder / frame.get("personal_mask_path", frame["mask_path"])
        masks.append(_read_resized(personal, scene.cameras, "L")[..., 0] > 0.0)
        if "transient_mask_path" in frame:
            transient = _read_resized(folder / frame["transient_mask_path"], scene.cameras, "L")
            passers_by.append(transient[..., 0] > 0.0)
        else:
            passers_by.append(torch.zeros_like(masks[-1]))
        rgba = _read_resized(folder / frame["clean_path"], scene.cameras, "RGBA")
        bg = torch.tensor(background, dtype=torch.float32)
        clean.append(rgba[..., :3] * rgba[..., 3:] + (1.0 - rgba[..., 3:]) * bg)
    return CrowdUser(
        scene,
        torch.stack(masks),
        torch.stack(clean),
        meta.get("person", {}),
        torch.stack(passers_by),
    )


def _read_resized(path: Path, cameras: Cameras, mode: str) -> Tensor:
    """[H, W, C] floats of an image resized by area averaging to the cameras' size.

    RGBA is averaged premultiplied (as the scene loader does) and returned straight.
    """
    with Image.open(path) as image:
        array = np.asarray(image.convert(mode), dtype=np.float32) / 255.0
    tensor = torch.from_numpy(array.reshape(array.shape[0], array.shape[1], -1))
    if mode == "RGBA":
        tensor = torch.cat([tensor[..., :3] * tensor[..., 3:], tensor[..., 3:]], dim=-1)
    if (tensor.shape[1], tensor.shape[0]) != (cameras.width, cameras.height):
        tensor = torch.nn.functional.interpolate(
            tensor.permute(2, 0, 1)[None],
            size=(cameras.height, cameras.width),
            mode="area",
        )[0].permute(1, 2, 0)
    if mode == "RGBA":
        alpha = tensor[..., 3:]
        rgb = torch.where(alpha > 0, tensor[..., :3] / alpha.clamp(min=1e-8), 0.0)
        tensor = torch.cat([rgb, alpha], dim=-1)
    return tensor


@dataclass
class CrowdData:
    """Every user's views with their masks and clean images, and the held-out clean views."""

    users: list[CrowdUser]
    heldout: Scene | None

    @classmethod
    def load(cls, data_dir: str | Path, downscale: float) -> CrowdData:
        """Read a `fedfields data crowd` folder; a clear error if it is not one."""
        root = Path(data_dir)
        folders = sorted(root.glob("user_*"))
        if not folders:
            raise FileNotFoundError(
                f"{root}: no user_NN folders; build one with `fedfields data crowd`"
            )
        users = [load_crowd_user(folder, downscale=downscale) for folder in folders]
        heldout = None
        if (root / "heldout" / "transforms.json").is_file():
            heldout = load_scene(root / "heldout", downscale=downscale)
        return cls(users, heldout)
