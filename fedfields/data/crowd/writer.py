"""Writing a crowd: per-user transforms.json with images and masks, crowd.json, held-out views."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from fedfields.data.crowd.compositing import straight_rgba
from fedfields.data.crowd.config import CrowdError
from fedfields.data.crowd.contact_sheet import contact_sheet
from fedfields.data.crowd.records import Crowd, UserViews
from fedfields.geometry.cameras import project

CROWD_FORMAT = "fedfields-crowd-1"


def _png(path: Path, pixels: Tensor) -> None:
    """Write [H, W, C] floats in [0, 1] (C = 1, 3 or 4) as an 8-bit PNG."""
    array = (pixels.clamp(0.0, 1.0).numpy() * 255.0 + 0.5).astype(np.uint8)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[array.shape[-1]]
    Image.fromarray(array[..., 0] if mode == "L" else array, mode=mode).save(path)


def write_crowd(crowd: Crowd, out: Path, source: dict[str, Any] | None = None) -> None:
    """Write `out/user_NN/transforms.json` with images, masks and clean views, crowd.json and
    contact_sheet.png. Everything lands in a temporary folder renamed into place at the end."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CrowdError(f"{out}: output folder exists and is not empty")
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        _remove_tree(staging)
    staging.mkdir(parents=True)
    cameras = crowd.cameras
    for user in crowd.users:
        _write_user(staging / f"user_{user.user:02d}", user, crowd, source or {})
    if crowd.partition.left_out:
        _write_heldout(staging / "heldout", crowd)
    summary = {
        "format": CROWD_FORMAT,
        "source": source or {},
        "users": len(crowd.users),
        "image_size": [cameras.width, cameras.height],
        "layout": crowd.layout,
        "ground": None if crowd.ground is None else asdict(crowd.ground),
        "bounding_sphere": asdict(crowd.sphere),
        "partition": {"method": crowd.partition.method, **crowd.partition.stats()},
        "heldout_views": list(crowd.partition.left_out),
        "persons": [
            {
                "user": user.user,
                "views": list(user.views),
                **asdict(user.person),
                "anchor": list(user.person.anchor),
                "occlusion": user.occlusion,
                "coverage": user.coverage(),
            }
            for user in crowd.users
        ],
        "mean_coverage": {
            key: float(np.mean([user.coverage()[key] for user in crowd.users]))
            for key in ("static", "transient", "total")
        },
    }
    (staging / "crowd.json").write_text(json.dumps(summary, indent=2))
    contact_sheet(crowd).save(staging / "contact_sheet.png")
    if out.exists():
        out.rmdir()
    staging.rename(out)


def _write_heldout(folder: Path, crowd: Crowd) -> None:
    """The views no user holds, without personal content: novel views for evaluation."""
    (folder / "images").mkdir(parents=True)
    cameras = crowd.cameras
    clean = straight_rgba(crowd.scene)
    frames = []
    for view in crowd.partition.left_out:
        stem = f"r_{view:03d}.png"
        _png(folder / "images" / stem, clean[view])
        frames.append(
            {
                "file_path": f"images/{stem}",
                "transform_matrix": cameras.camera_to_world[view].tolist(),
                "source_view": view,
            }
        )
    meta = {
        **_intrinsics_and_bounds(crowd),
        "frames": frames,
    }
    (folder / "transforms.json").write_text(json.dumps(meta, indent=2))


def _intrinsics_and_bounds(crowd: Crowd) -> dict[str, Any]:
    """Top-level transforms.json keys shared by all written views (one camera model)."""
    cameras, scene = crowd.cameras, crowd.scene
    return {
        "w": cameras.width,
        "h": cameras.height,
        "fl_x": float(cameras.fx[0]),
        "fl_y": float(cameras.fy[0]),
        "cx": float(cameras.cx[0]),
        "cy": float(cameras.cy[0]),
        "aabb": scene.aabb.tolist(),
        "near": scene.near,
        "far": scene.far,
    }


def _write_user(folder: Path, user: UserViews, crowd: Crowd, source: dict[str, Any]) -> None:
    """One user's transforms.json plus images/, clean/ and masks/ (union), personal_masks/
    (the static person) and transient_masks/ (passers-by) PNGs."""
    for name in ("images", "masks", "personal_masks", "transient_masks", "clean"):
        (folder / name).mkdir(parents=True)
    cameras = crowd.cameras
    frames = []
    for position, view in enumerate(user.views):
        stem = f"r_{view:03d}.png"
        _png(folder / "images" / stem, user.rgba[position])
        _png(folder / "clean" / stem, user.clean_rgba[position])
        _png(folder / "masks" / stem, user.masks[position, ..., None].float())
        _png(folder / "personal_masks" / stem, user.personal_masks[position, ..., None].float())
        _png(folder / "transient_masks" / stem, user.transient_masks[position, ..., None].float())
        anchor_pixel, _ = project(cameras, view, torch.tensor([user.person.anchor]))
        frames.append(
            {
                "file_path": f"images/{stem}",
                "mask_path": f"masks/{stem}",
                "personal_mask_path": f"personal_masks/{stem}",
                "transient_mask_path": f"transient_masks/{stem}",
                "clean_path": f"clean/{stem}",
                "transform_matrix": cameras.camera_to_world[view].tolist(),
                "fl_x": float(cameras.fx[view]),
                "fl_y": float(cameras.fy[view]),
                "cx": float(cameras.cx[view]),
                "cy": float(cameras.cy[view]),
                "source_view": view,
                "anchor_pixel": anchor_pixel[0].tolist(),
                "personal_pixels": int(user.masks[position].sum()),
                "transient_persons": [asdict(spec) for spec in user.transients[position]],
                "coverage": user.coverage(position),
            }
        )
    meta = {
        **_intrinsics_and_bounds(crowd),
        "user": user.user,
        "person": {**asdict(user.person), "anchor": list(user.person.anchor)},
        "occlusion": user.occlusion,
        "coverage": user.coverage(),
        "bounding_sphere": asdict(crowd.sphere),
        "source": source,
        "frames": frames,
    }
    (folder / "transforms.json").write_text(json.dumps(meta, indent=2))


def _remove_tree(path: Path) -> None:
    """Delete a staging folder left by an interrupted run."""
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()
