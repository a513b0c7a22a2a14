"""Scene loader: intrinsics, compositing, downscaling, splits and every malformed case."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from fedfields.data import Scene, SceneError, holdout_indices, load_scene

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
WIDTH, HEIGHT = 8, 6
ANGLE_X = 0.9


def _rgba(seed: int, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """Deterministic RGBA pixels with alpha covering 0, 255 and values between."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 4), dtype=np.uint8)
    pixels[0, 0, 3], pixels[0, 1, 3] = 0, 255
    return pixels


def _pose(i: int) -> list[list[float]]:
    """A distinct camera-to-world matrix per frame."""
    angle = 0.3 * i
    return [
        [math.cos(angle), 0.0, math.sin(angle), 0.5 * i],
        [0.0, 1.0, 0.0, -0.25 * i],
        [-math.sin(angle), 0.0, math.cos(angle), 4.0],
        [0.0, 0.0, 0.0, 1.0],
    ]


def _write_scene(
    root: Path, num_frames: int = 4, json_name: str = "transforms.json", first: int = 0, **top: Any
) -> dict[str, Any]:
    """Write frames first..first+num_frames-1 as RGBA PNGs and a Blender-style json; return it."""
    (root / "train").mkdir(parents=True, exist_ok=True)
    frames = []
    for i in range(first, first + num_frames):
        Image.fromarray(_rgba(i), mode="RGBA").save(root / "train" / f"r_{i}.png")
        frames.append({"file_path": f"./train/r_{i}", "transform_matrix": _pose(i)})
    meta = {"camera_angle_x": ANGLE_X, **top, "frames": frames}
    _write_json(root / json_name, meta)
    return meta


def _write_json(path: Path, meta: dict[str, Any]) -> None:
    path.write_text(json.dumps(meta, indent=2))


def _composite(rgba: np.ndarray, background: tuple[float, float, float]) -> np.ndarray:
    """Straight-alpha compositing computed independently of the loader."""
    pixels = rgba.astype(np.float64) / 255.0
    alpha = pixels[..., 3:]
    return pixels[..., :3] * alpha + np.asarray(background) * (1.0 - alpha)


def test_blender_intrinsics_poses_and_paths(tmp_path: Path) -> None:
    _write_scene(tmp_path)
    scene = load_scene(tmp_path)
    cameras = scene.cameras
    focal = 0.5 * WIDTH / math.tan(0.5 * ANGLE_X)
    assert len(scene) == len(cameras) == 4
    assert (cameras.width, cameras.height) == (WIDTH, HEIGHT)
    assert scene.images.shape == (4, HEIGHT, WIDTH, 3) and scene.images.dtype == torch.float32
    assert scene.masks.shape == (4, HEIGHT, WIDTH)
    torch.testing.assert_close(cameras.fx, torch.full((4,), focal))
    torch.testing.assert_close(cameras.fy, torch.full((4,), focal))
    torch.testing.assert_close(cameras.cx, torch.full((4,), WIDTH / 2))
    torch.testing.assert_close(cameras.cy, torch.full((4,), HEIGHT / 2))
    expected_poses = torch.tensor([_pose(i) for i in range(4)], dtype=torch.float32)
    torch.testing.assert_close(cameras.camera_to_world, expected_poses)
    assert scene.image_paths == tuple(tmp_path / "train" / f"r_{i}.png" for i in range(4))


def test_camera_angle_y_gives_fy(tmp_path: Path) -> None:
    _write_scene(tmp_path, camera_angle_y=0.7)
    cameras = load_scene(tmp_path).cameras
    assert cameras.fx[0].item() == pytest.approx(0.5 * WIDTH / math.tan(0.45))
    assert cameras.fy[0].item() == pytest.approx(0.5 * HEIGHT / math.tan(0.35))


def test_instant_ngp_intrinsics(tmp_path: Path) -> None:
    meta = _write_scene(tmp_path, fl_x=11.0, fl_y=12.5, cx=3.5, cy=2.75, w=WIDTH, h=HEIGHT)
    del meta["camera_angle_x"]
    _write_json(tmp_path / "transforms.json", meta)
    cameras = load_scene(tmp_path).cameras
    torch.testing.assert_close(cameras.fx, torch.full((4,), 11.0))
    torch.testing.assert_close(cameras.fy, torch.full((4,), 12.5))
    torch.testing.assert_close(cameras.cx, torch.full((4,), 3.5))
    torch.testing.assert_close(cameras.cy, torch.full((4,), 2.75))


def test_single_focal_serves_both_axes(tmp_path: Path) -> None:
    meta = _write_scene(tmp_path, fl_y=9.0)
    del meta["camera_angle_x"]
    _write_json(tmp_path / "transforms.json", meta)
    cameras = load_scene(tmp_path).cameras
    torch.testing.assert_close(cameras.fx, torch.full((4,), 9.0))
    torch.testing.assert_close(cameras.fy, torch.full((4,), 9.0))


def test_per_frame_intrinsics_override_top_level(tmp_path: Path) -> None:
    meta = _write_scene(tmp_path, fl_x=10.0, cx=4.0)
    del meta["camera_angle_x"]
    meta["frames"][2].update(fl_x=20.0, cx=3.0, cy=2.0)
    _write_json(tmp_path / "transforms.json", meta)
    cameras = load_scene(tmp_path).cameras
    torch.testing.assert_close(cameras.fx, torch.tensor([10.0, 10.0, 20.0, 10.0]))
    torch.testing.assert_close(cameras.cx, torch.tensor([4.0, 4.0, 3.0, 4.0]))
    torch.testing.assert_close(cameras.cy, torch.tensor([3.0, 3.0, 2.0, 3.0]))


@pytest.mark.parametrize("background", [(1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.2, 0.5, 0.9)])
def test_rgba_composited_on_background(tmp_path: Path, background: tuple) -> None:
    _write_scene(tmp_path)
    scene = load_scene(tmp_path, background=background)
    expected = np.stack([_composite(_rgba(i), background) for i in range(4)])
    np.testing.assert_allclose(scene.images.numpy(), expected, atol=1e-6)
    expected_masks = np.stack([_rgba(i)[..., 3] / 255.0 for i in range(4)])
    np.testing.assert_allclose(scene.masks.numpy(), expected_masks, atol=1e-6)
    assert scene.background == background


def test_rgb_images_have_full_masks(tmp_path: Path) -> None:
    _write_scene(tmp_path)
    rgb = _rgba(7)[..., :3]
    Image.fromarray(rgb, mode="RGB").save(tmp_path / "train" / "r_1.png")
    scene = load_scene(tmp_path, background=(0.0, 0.0, 0.0))
    np.testing.assert_allclose(scene.images[1].numpy(), rgb / 255.0, atol=1e-6)
    assert torch.equal(scene.masks[1], torch.ones(HEIGHT, WIDTH))
    assert scene.masks[0].min() < 1


def test_downscale_box_averages_composited_pixels(tmp_path: Path) -> None:
    _write_scene(tmp_path)
    scene = load_scene(tmp_path, downscale=2, background=(0.0, 1.0, 0.5))
    assert scene.images.shape == (4, HEIGHT // 2, WIDTH // 2, 3)
    for i in range(4):
        rgba = _rgba(i)
        composited = _composite(rgba, (0.0, 1.0, 0.5))
        pooled = composited.reshape(HEIGHT // 2, 2, WIDTH // 2, 2, 3).mean(axis=(1, 3))
        alpha = (rgba[..., 3] / 255.0).reshape(HEIGHT // 2, 2, WIDTH // 2, 2).mean(axis=(1, 3))
        np.testing.assert_allclose(scene.images[i].numpy(), pooled, atol=1e-6)
        np.testing.assert_allclose(scene.masks[i].numpy(), alpha, atol=1e-6)
    focal = 0.5 * WIDTH / math.tan(0.5 * ANGLE_X)
    torch.testing.assert_close(scene.cameras.fx, torch.full((4,), focal / 2))
    torch.testing.assert_close(scene.cameras.cx, torch.full((4,), WIDTH / 4))
    torch.testing.assert_close(scene.cameras.cy, torch.full((4,), HEIGHT / 4))


def test_fractional_downscale_rounds_size_and_scales_each_axis(tmp_path: Path) -> None:
    _write_scene(tmp_path, fl_x=10.0, fl_y=10.0)
    cameras = load_scene(tmp_path, downscale=1.5).cameras
    assert (cameras.width, cameras.height) == (5, 4)  # round(8 / 1.5), round(6 / 1.5)
    torch.testing.assert_close(cameras.fx, torch.full((4,), 10.0 * 5 / 8))
    torch.testing.assert_close(cameras.fy, torch.full((4,), 10.0 * 4 / 6))
    torch.testing.assert_close(cameras.cy, torch.full((4,), 2.0))


def test_split_selection(tmp_path: Path) -> None:
    _write_scene(tmp_path, num_frames=3, json_name="transforms_train.json")
    _write_scene(tmp_path, num_frames=2, json_name="transforms_test.json", first=3)
    everything = load_scene(tmp_path)
    assert [p.name for p in everything.image_paths] == [f"r_{i}.png" for i in range(5)]
    assert len(load_scene(tmp_path, split="train")) == 3
    assert [p.name for p in load_scene(tmp_path, split="test").image_paths] == [
        "r_3.png",
        "r_4.png",
    ]
    with pytest.raises(SceneError, match=r"transforms_val\.json.*not found"):
        load_scene(tmp_path, split="val")


def test_split_tags_in_one_transforms_json(tmp_path: Path) -> None:
    meta = _write_scene(tmp_path, num_frames=4)
    for frame, tag in zip(meta["frames"], ["support", "query", "support", "query"], strict=True):
        frame["split"] = tag
    _write_json(tmp_path / "transforms.json", meta)
    assert len(load_scene(tmp_path)) == 4
    assert [p.name for p in load_scene(tmp_path, split="support").image_paths] == [
        "r_0.png",
        "r_2.png",
    ]
    with pytest.raises(SceneError, match=r"transforms\.json.*no frame.*'test'"):
        load_scene(tmp_path, split="test")


def test_split_files_take_precedence_order_train_val_test(tmp_path: Path) -> None:
    _write_scene(tmp_path, num_frames=1, json_name="transforms_test.json", first=2)
    _write_scene(tmp_path, num_frames=1, json_name="transforms_val.json", first=1)
    _write_scene(tmp_path, num_frames=1, json_name="transforms_train.json", first=0)
    assert [p.name for p in load_scene(tmp_path).image_paths] == ["r_0.png", "r_1.png", "r_2.png"]


def test_image_extensions_resolved(tmp_path: Path) -> None:
    meta = _write_scene(tmp_path, num_frames=2)
    Image.fromarray(_rgba(5)[..., :3]).save(tmp_path / "train" / "photo.jpg")
    meta["frames"][0]["file_path"] = "train/r_0.png"
    meta["frames"][1]["file_path"] = "./train/photo"
    _write_json(tmp_path / "transforms.json", meta)
    paths = load_scene(tmp_path).image_paths
    assert paths == (tmp_path / "train" / "r_0.png", tmp_path / "train" / "photo.jpg")


def test_bounds_from_json_and_defaults(tmp_path: Path) -> None:
    _write_scene(tmp_path)
    default = load_scene(tmp_path)
    torch.testing.assert_close(default.aabb, torch.tensor([[-1.5] * 3, [1.5] * 3]))
    assert (default.near, default.far) == (2.0, 6.0)
    _write_scene(tmp_path, aabb=[[-1, -2, -3], [1, 2, 3]], near=0.5, far=3.0)
    given = load_scene(tmp_path)
    torch.testing.assert_close(given.aabb, torch.tensor([[-1.0, -2.0, -3.0], [1.0, 2.0, 3.0]]))
    assert (given.near, given.far) == (0.5, 3.0)


def test_subset_selects_views_in_order(tmp_path: Path) -> None:
    _write_scene(tmp_path)
    scene = load_scene(tmp_path)
    part = scene.subset([3, 1])
    assert isinstance(part, Scene) and len(part) == 2
    assert torch.equal(part.images, scene.images[[3, 1]])
    assert torch.equal(part.masks, scene.masks[[3, 1]])
    assert torch.equal(part.cameras.camera_to_world, scene.cameras.camera_to_world[[3, 1]])
    assert torch.equal(part.cameras.fx, scene.cameras.fx[[3, 1]])
    assert part.image_paths == (scene.image_paths[3], scene.image_paths[1])
    assert (
        scene.subset(torch.tensor([False, True, True, False])).image_paths == scene.image_paths[1:3]
    )


def test_holdout_indices() -> None:
    assert holdout_indices(10, 4) == ([1, 2, 3, 5, 6, 7, 9], [0, 4, 8])
    assert holdout_indices(3, 3) == ([1, 2], [0])
    with pytest.raises(ValueError, match="every=0"):
        holdout_indices(10, 0)
    with pytest.raises(ValueError, match="every=11"):
        holdout_indices(10, 11)


def _break(path: str, value: Any) -> Callable[[Path, dict[str, Any]], None]:
    """A mutation setting meta[path] (dotted, integer segments index lists) to `value`."""

    def mutate(root: Path, meta: dict[str, Any]) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        target: Any = meta
        for key in parents:
            target = target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value

    return mutate


_DELETE = object()


def _remove_image(root: Path, meta: dict[str, Any]) -> None:
    (root / "train" / "r_2.png").unlink()


def _resize_image(root: Path, meta: dict[str, Any]) -> None:
    Image.fromarray(_rgba(2, width=4, height=4)).save(root / "train" / "r_2.png")


def _no_intrinsics(root: Path, meta: dict[str, Any]) -> None:
    del meta["camera_angle_x"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_remove_image, r"transforms\.json.*frame 2.*image file not found.*r_2"),
        (_break("frames", _DELETE), r"transforms\.json.*'frames'"),
        (_break("frames.1.file_path", _DELETE), r"transforms\.json.*frame 1.*missing 'file_path'"),
        (_break("frames.1.transform_matrix", _DELETE), r"frame 1.*missing 'transform_matrix'"),
        (_break("frames.3.transform_matrix", _pose(3)[:3]), r"transforms\.json.*frame 3.*4x4"),
        (_break("frames.0.transform_matrix.0.0", float("nan")), r"frame 0.*non-finite"),
        (_break("frames.0.transform_matrix.0", [1, 2]), r"frame 0.*transform_matrix"),
        (_no_intrinsics, r"transforms\.json.*no intrinsics"),
        (_break("w", WIDTH + 1), r"transforms\.json.*r_0\.png is 8x6.*w=9"),
        (_break("camera_angle_x", "wide"), r"transforms\.json.*camera_angle_x.*positive number"),
        (_resize_image, r"transforms\.json.*r_2\.png is 4x4.*r_0\.png is 8x6.*different sizes"),
        (_break("aabb", [[1, 1, 1], [0, 0, 0]]), r"transforms\.json.*'aabb'"),
    ],
)
def test_malformed_scene_raises_scene_error(
    tmp_path: Path, mutate: Callable[[Path, dict[str, Any]], None], message: str
) -> None:
    meta = _write_scene(tmp_path)
    mutate(tmp_path, meta)
    _write_json(tmp_path / "transforms.json", meta)
    with pytest.raises(SceneError, match=message):
        load_scene(tmp_path)


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    _write_scene(tmp_path)
    (tmp_path / "transforms.json").write_text('{\n  "camera_angle_x": 0.9,\n  "frames": [,]\n}')
    with pytest.raises(SceneError, match=r"transforms\.json: malformed JSON at line 3"):
        load_scene(tmp_path)


def test_missing_json_names_directory(tmp_path: Path) -> None:
    with pytest.raises(SceneError, match=rf"{tmp_path.name}: no transforms\.json"):
        load_scene(tmp_path)


@pytest.mark.parametrize("downscale", [0, -2.0])
def test_non_positive_downscale_rejected(tmp_path: Path, downscale: float) -> None:
    _write_scene(tmp_path)
    with pytest.raises(SceneError, match="downscale must be > 0"):
        load_scene(tmp_path, downscale=downscale)


@pytest.mark.skipif(not LEGO.is_dir(), reason="bundled lego scene not present")
def test_bundled_lego_at_half_resolution() -> None:
    scene = load_scene(LEGO, split="train", downscale=2)
    assert scene.images.shape == (80, 100, 100, 3)
    assert scene.masks.shape == (80, 100, 100)
    expected_focal = 0.5 * 100 / math.tan(0.5 * 0.6911112070083618)
    torch.testing.assert_close(scene.cameras.fx, torch.full((80,), expected_focal))
    assert scene.masks.min() < 0.01 and scene.masks.max() > 0.99
    assert scene.images.min() >= 0.0 and scene.images.max() <= 1.0
