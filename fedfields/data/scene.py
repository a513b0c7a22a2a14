"""Load posed-image scenes from `transforms.json` files (Blender / instant-ngp / nerfstudio).

Parsing and validating every frame happens before any pixel is decoded, so a malformed
scene fails with a `SceneError` naming the file and the problem instead of half-loading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from fedfields.geometry.cameras import Cameras, as_index

SPLITS = ("train", "val", "test")
IMAGE_SUFFIXES = ("", ".png", ".jpg", ".jpeg")
INTRINSIC_KEYS = ("fl_x", "fl_y", "cx", "cy", "w", "h", "camera_angle_x", "camera_angle_y")
DEFAULT_AABB = ((-1.5, -1.5, -1.5), (1.5, 1.5, 1.5))  # NeRF-synthetic object box
DEFAULT_NEAR, DEFAULT_FAR = 2.0, 6.0  # NeRF-synthetic ray bounds


class SceneError(ValueError):
    """Malformed or inconsistent scene; message names the file and the problem."""


@dataclass(frozen=True)
class Scene:
    """Images composited on `background`, their alpha masks, cameras and scene bounds."""

    images: torch.Tensor  # [N, H, W, 3] float32 in [0, 1]
    masks: torch.Tensor  # [N, H, W] float32 alpha (ones when images have no alpha)
    cameras: Cameras
    image_paths: tuple[Path, ...]
    background: tuple[float, float, float]
    aabb: torch.Tensor  # [2, 3] float32 min/max corners
    near: float
    far: float

    def __len__(self) -> int:
        return self.images.shape[0]

    def subset(self, indices: Sequence[int] | torch.Tensor) -> Scene:
        """The views at `indices` (ints or a boolean mask), sharing background and bounds."""
        index = as_index(indices)
        return Scene(
            images=self.images[index],
            masks=self.masks[index],
            cameras=self.cameras.subset(index),
            image_paths=tuple(self.image_paths[i] for i in index.tolist()),
            background=self.background,
            aabb=self.aabb,
            near=self.near,
            far=self.far,
        )

    def to(self, device: torch.device | str) -> Scene:
        """The same scene with images, masks and cameras on `device`."""
        return replace(
            self,
            images=self.images.to(device),
            masks=self.masks.to(device),
            cameras=self.cameras.to(device),
        )


@dataclass(frozen=True)
class _Frame:
    """One validated frame before its pixels are read."""

    json_path: Path
    label: str  # "frame 3 ('./train/r_3')", for error messages
    image_path: Path
    camera_to_world: np.ndarray  # [4, 4] float64
    camera: dict[str, float]  # intrinsic keys, per-frame values overriding top-level ones
    split: str | None  # the frame's own "split" tag, if any


def load_scene(
    scene_dir: str | Path,
    split: str | None = None,
    downscale: float = 1.0,
    background: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Scene:
    """Load a scene directory holding `transforms.json` or `transforms_{train,val,test}.json`.

    split=None loads every file present (train, val, test order); a split name loads only
    that file, or, in a single transforms.json, only the frames whose "split" tag equals it
    (how object collections mark support and query views). `downscale` F resizes to
    round(W/F) x round(H/F) by box (area) averaging.
    Top-level "aabb" (default +-1.5 cube) and "near"/"far" (default 2 and 6) give the
    bounds; the defaults are those of the NeRF-synthetic scenes.
    """
    scene_dir = Path(scene_dir)
    if not downscale > 0:
        raise SceneError(f"{scene_dir}: downscale must be > 0, got {downscale}")
    if len(background) != 3:
        raise ValueError(f"background must be 3 floats (r, g, b), got {background!r}")
    json_paths = _scene_files(scene_dir, split)
    metas = [_read_json(path) for path in json_paths]
    frames = [
        frame for path, meta in zip(json_paths, metas, strict=True) for frame in _frames(path, meta)
    ]
    if split is not None and json_paths[0].name == "transforms.json":
        frames = [frame for frame in frames if frame.split == split]
        if not frames:
            raise SceneError(f'{json_paths[0]}: no frame has "split": {split!r}')
    width, height = _common_image_size(frames)
    intrinsics = np.array([_intrinsics(frame, width, height) for frame in frames])
    new_width, new_height = round(width / downscale), round(height / downscale)
    if new_width < 1 or new_height < 1:
        raise SceneError(f"{scene_dir}: downscale {downscale} leaves no pixels of {width}x{height}")
    aabb, near, far = _bounds(json_paths, metas)

    rgba = np.empty((len(frames), new_height, new_width, 4), dtype=np.float32)
    background_array = np.asarray(background, dtype=np.float32)
    for i, frame in enumerate(frames):
        rgba[i] = _box_resize(
            _composited(_read_rgba(frame), background_array), new_width, new_height
        )
    sx, sy = new_width / width, new_height / height
    cameras = Cameras(
        camera_to_world=torch.tensor(
            np.stack([f.camera_to_world for f in frames]), dtype=torch.float32
        ),
        fx=torch.tensor(intrinsics[:, 0] * sx, dtype=torch.float32),
        fy=torch.tensor(intrinsics[:, 1] * sy, dtype=torch.float32),
        cx=torch.tensor(intrinsics[:, 2] * sx, dtype=torch.float32),
        cy=torch.tensor(intrinsics[:, 3] * sy, dtype=torch.float32),
        width=new_width,
        height=new_height,
    )
    images = torch.from_numpy(rgba)
    return Scene(
        images=images[..., :3].clamp(0.0, 1.0).contiguous(),
        masks=images[..., 3].clamp(0.0, 1.0).contiguous(),
        cameras=cameras,
        image_paths=tuple(frame.image_path for frame in frames),
        background=(float(background[0]), float(background[1]), float(background[2])),
        aabb=torch.tensor(aabb, dtype=torch.float32),
        near=near,
        far=far,
    )


def holdout_indices(num_views: int, every: int) -> tuple[list[int], list[int]]:
    """(train, heldout): views 0, every, 2*every, ... are held out (LLFF convention)."""
    if every <= 0 or every > num_views:
        raise ValueError(f"holdout every={every} must be in [1, num_views={num_views}]")
    heldout = list(range(0, num_views, every))
    return [i for i in range(num_views) if i % every != 0], heldout


def _scene_files(scene_dir: Path, split: str | None) -> list[Path]:
    """The transforms files to read, in train, val, test order."""
    if split is not None:
        path = scene_dir / f"transforms_{split}.json"
        if path.is_file():
            return [path]
        if (scene_dir / "transforms.json").is_file():
            return [scene_dir / "transforms.json"]
        raise SceneError(f"{path}: split file for split {split!r} not found")
    split_paths = [scene_dir / f"transforms_{name}.json" for name in SPLITS]
    present = [path for path in split_paths if path.is_file()]
    if present:
        return present
    if (scene_dir / "transforms.json").is_file():
        return [scene_dir / "transforms.json"]
    raise SceneError(f"{scene_dir}: no transforms.json or transforms_{{train,val,test}}.json")


def _read_json(path: Path) -> dict[str, Any]:
    """Parsed top-level object of a transforms file."""
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SceneError(
            f"{path}: malformed JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from error
    if not isinstance(meta, dict):
        raise SceneError(f"{path}: top level must be a JSON object")
    return meta


def _frames(json_path: Path, meta: dict[str, Any]) -> list[_Frame]:
    """Validated frames of one transforms file (images located, matrices and numbers checked)."""
    entries = meta.get("frames")
    if not isinstance(entries, list) or not entries:
        raise SceneError(f"{json_path}: missing or empty 'frames' list")
    top_camera = _camera_values(json_path, "top level", meta)
    frames = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise SceneError(f"{json_path}: frame {index} is not a JSON object")
        label = f"frame {index} ({entry.get('file_path')!r})"
        for key in ("file_path", "transform_matrix"):
            if key not in entry:
                raise SceneError(f"{json_path}: {label} is missing '{key}'")
        frames.append(
            _Frame(
                json_path=json_path,
                label=label,
                image_path=_image_path(json_path, label, entry["file_path"]),
                camera_to_world=_matrix(json_path, label, entry["transform_matrix"]),
                camera=top_camera | _camera_values(json_path, label, entry),
                split=entry.get("split"),
            )
        )
    return frames


def _camera_values(json_path: Path, where: str, entry: dict[str, Any]) -> dict[str, float]:
    """The intrinsic keys present in `entry`, checked to be finite positive numbers."""
    values = {}
    for key in INTRINSIC_KEYS:
        if key not in entry:
            continue
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise SceneError(
                f"{json_path}: {where} '{key}' must be a positive number, got {value!r}"
            )
        if not math.isfinite(value):
            raise SceneError(f"{json_path}: {where} '{key}' is not finite: {value!r}")
        values[key] = float(value)
    return values


def _image_path(json_path: Path, label: str, file_path: Any) -> Path:
    """The existing image for `file_path` (relative to the json), trying common extensions."""
    if not isinstance(file_path, str):
        raise SceneError(f"{json_path}: {label} 'file_path' must be a string")
    base = json_path.parent / file_path
    for suffix in IMAGE_SUFFIXES:
        candidate = Path(f"{base}{suffix}")
        if candidate.is_file():
            return candidate
    raise SceneError(
        f"{json_path}: {label} image file not found: {base} (also tried .png/.jpg/.jpeg)"
    )


def _matrix(json_path: Path, label: str, value: Any) -> np.ndarray:
    """A finite 4x4 camera-to-world matrix."""
    try:
        matrix = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise SceneError(
            f"{json_path}: {label} 'transform_matrix' is not numeric: {error}"
        ) from error
    if matrix.shape != (4, 4):
        raise SceneError(
            f"{json_path}: {label} 'transform_matrix' must be 4x4, got shape {matrix.shape}"
        )
    if not np.isfinite(matrix).all():
        raise SceneError(f"{json_path}: {label} 'transform_matrix' has non-finite numbers")
    return matrix


def _common_image_size(frames: list[_Frame]) -> tuple[int, int]:
    """(width, height) shared by all frames, read from the image headers only."""
    sizes = []
    for frame in frames:
        try:
            with Image.open(frame.image_path) as image:
                sizes.append(image.size)
        except OSError as error:
            raise SceneError(f"{frame.image_path}: unreadable image: {error}") from error
    for frame, size in zip(frames, sizes, strict=True):
        if size != sizes[0]:
            raise SceneError(
                f"{frame.json_path}: {frame.label} image {frame.image_path.name} is "
                f"{size[0]}x{size[1]} but {frames[0].image_path.name} is "
                f"{sizes[0][0]}x{sizes[0][1]}; frames of different sizes in one scene"
            )
    return sizes[0]


def _intrinsics(frame: _Frame, width: int, height: int) -> tuple[float, float, float, float]:
    """(fx, fy, cx, cy) in pixels from fl_x/fl_y or camera_angle_x/y; centre defaults to W/2, H/2.

    A single given focal (or angle) serves both axes.
    """
    camera = frame.camera
    for key, actual in (("w", width), ("h", height)):
        if key in camera and camera[key] != actual:
            raise SceneError(
                f"{frame.json_path}: {frame.label} image {frame.image_path.name} is "
                f"{width}x{height} but intrinsics give {key}={camera[key]:g}"
            )
    fx = _focal(camera, "fl_x", "camera_angle_x", width)
    fy = _focal(camera, "fl_y", "camera_angle_y", height)
    if fx is None and fy is None:
        raise SceneError(
            f"{frame.json_path}: {frame.label} has no intrinsics "
            "(need camera_angle_x/y or fl_x/fl_y)"
        )
    fx = fy if fx is None else fx
    fy = fx if fy is None else fy
    return fx, fy, camera.get("cx", width / 2), camera.get("cy", height / 2)


def _focal(camera: dict[str, float], focal_key: str, angle_key: str, size: int) -> float | None:
    """Focal length in pixels from an explicit focal or a field-of-view angle in radians."""
    if focal_key in camera:
        return camera[focal_key]
    if angle_key in camera:
        return 0.5 * size / math.tan(0.5 * camera[angle_key])
    return None


def _bounds(
    json_paths: list[Path], metas: list[dict[str, Any]]
) -> tuple[list[list[float]], float, float]:
    """Scene box and near/far from the first file giving them, else the NeRF-synthetic defaults."""
    aabb = next(
        ((p, m["aabb"]) for p, m in zip(json_paths, metas, strict=True) if "aabb" in m), None
    )
    near = next(
        ((p, m["near"]) for p, m in zip(json_paths, metas, strict=True) if "near" in m), None
    )
    far = next(((p, m["far"]) for p, m in zip(json_paths, metas, strict=True) if "far" in m), None)
    box = np.asarray(DEFAULT_AABB) if aabb is None else _aabb(*aabb)
    near_value = DEFAULT_NEAR if near is None else _bound(*near, "near")
    far_value = DEFAULT_FAR if far is None else _bound(*far, "far")
    if not near_value < far_value:
        raise SceneError(f"{json_paths[0]}: near {near_value} must be < far {far_value}")
    return box.tolist(), near_value, far_value


def _aabb(json_path: Path, value: Any) -> np.ndarray:
    """A finite [2, 3] box with min < max."""
    try:
        box = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise SceneError(f"{json_path}: 'aabb' is not numeric: {error}") from error
    if box.shape != (2, 3) or not np.isfinite(box).all() or not (box[0] < box[1]).all():
        raise SceneError(
            f"{json_path}: 'aabb' must be finite [[x0,y0,z0],[x1,y1,z1]] with min < max"
        )
    return box


def _bound(json_path: Path, value: Any, key: str) -> float:
    """A finite non-negative ray bound."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise SceneError(f"{json_path}: '{key}' must be a finite number >= 0, got {value!r}")
    return float(value)


def _read_rgba(frame: _Frame) -> np.ndarray:
    """[H, W, 4] float32 in [0, 1]; images without alpha get alpha = 1."""
    try:
        with Image.open(frame.image_path) as image:
            return np.asarray(image.convert("RGBA"), dtype=np.float32) / 255.0
    except OSError as error:
        raise SceneError(f"{frame.image_path}: unreadable image: {error}") from error


def _composited(rgba: np.ndarray, background: np.ndarray) -> np.ndarray:
    """Straight-alpha RGBA with rgb blended over `background`: rgb*a + bg*(1-a); alpha kept."""
    alpha = rgba[..., 3:]
    rgb = rgba[..., :3] * alpha + background * (1.0 - alpha)
    return np.concatenate([rgb, alpha], axis=-1)


def _box_resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """[H, W, C] float32 resized by box (area) averaging, channel by channel in float."""
    if image.shape[1] == width and image.shape[0] == height:
        return image
    channels = [
        np.asarray(
            Image.fromarray(np.ascontiguousarray(image[..., c])).resize((width, height), Image.BOX)
        )
        for c in range(image.shape[-1])
    ]
    return np.stack(channels, axis=-1)
