"""Image and video tasks: exact pixel round trips, grid ordering, loaders' errors, client split."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import skimage.data
import skimage.transform
import torch
from PIL import Image, ImageSequence

from fedfields.data.tasks import (
    PHOTOS,
    SKIMAGE_GIF,
    ImageTask,
    VideoTask,
    client_tasks,
    coordinate_grid,
    frame_folder,
    gif_video,
    image_folder,
    lfw_faces,
    photo_crops,
    skimage_images,
)


def _save(path: Path, pixels: np.ndarray) -> None:
    Image.fromarray(pixels).save(path)


def _random_rgb(seed: int, height: int = 5, width: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _pixel_nearest(task: ImageTask, row: float, col: float) -> torch.Tensor:
    """The pixel whose (row, col) coordinate lies closest to the given point."""
    distance = (task.coords - torch.tensor([row, col])).norm(dim=1)
    return task.pixels[torch.argmin(distance)]


def test_coordinate_grid_spans_unit_cube_in_pixel_order() -> None:
    grid = coordinate_grid((3, 4, 5))
    assert grid.shape == (60, 3) and grid.dtype == torch.float32
    assert grid.min() == -1 and grid.max() == 1
    assert torch.equal(grid[0], torch.tensor([-1.0, -1.0, -1.0]))
    assert torch.equal(grid[1], torch.tensor([-1.0, -1.0, -0.5]))  # last axis varies fastest
    assert torch.equal(grid[-1], torch.tensor([1.0, 1.0, 1.0]))


def test_image_task_round_trips_and_orders_coords_like_pixels() -> None:
    source = _random_rgb(0)
    task = ImageTask.from_array("random", source)
    assert task.shape == (5, 7, 3) and task.coords.shape == (35, 2)
    assert torch.equal(task.image(), torch.from_numpy(source).float() / 255)
    assert torch.equal(_pixel_nearest(task, -1.0, -1.0), task.image()[0, 0])
    assert torch.equal(_pixel_nearest(task, 0.5, 1.0), task.image()[3, 6])  # (row 3 of 5, col 6)


def test_task_rejects_inconsistent_shapes() -> None:
    with pytest.raises(ValueError, match="needs coords"):
        ImageTask("bad", coordinate_grid((2, 2)), torch.zeros(4, 3), shape=(2, 3, 3))


def test_lfw_faces_are_the_first_hundred_crops() -> None:
    faces = lfw_faces()
    source = skimage.data.lfw_subset()
    assert len(faces) == 100 and faces[0].shape == (25, 25, 1)
    for index in (0, 57, 99):
        expected = torch.from_numpy(source[index].astype(np.float32))[..., None]
        assert torch.equal(faces[index].image(), expected)
    small = lfw_faces(count=3, size=16)
    assert len(small) == 3 and small[0].image().shape == (16, 16, 1)
    with pytest.raises(ValueError, match="100 faces"):
        lfw_faces(count=101)


def test_skimage_images_resize_and_channels() -> None:
    astronaut, camera = skimage_images(("astronaut", "camera"), size=16)
    assert astronaut.shape == (16, 16, 3) and camera.shape == (16, 16, 1)
    assert 0.0 <= float(astronaut.pixels.min()) and float(astronaut.pixels.max()) <= 1.0
    (grey,) = skimage_images(("chelsea",), size=8, grey=True)
    assert grey.shape == (8, 8, 1)
    with pytest.raises(ValueError, match="no image 'not_an_image'"):
        skimage_images(("not_an_image",))


def test_photo_crops_are_disjoint_grid_cells_of_the_photos() -> None:
    """Each crop is the resized photo region its name gives, on the crop grid; no two share a
    pixel; photos take turns; more crops than the photos hold is refused."""
    crops = photo_crops(12, size=16, crop=128, seed=3)
    assert [c.name.rsplit("_", 2)[0] for c in crops[:5]] == list(PHOTOS)
    regions = set()
    for task in crops:
        name, top, left = task.name.rsplit("_", 2)
        top, left = int(top), int(left)
        assert top % 128 == 0 and left % 128 == 0 and (name, top, left) not in regions
        regions.add((name, top, left))
        photo = getattr(skimage.data, name)()[top : top + 128, left : left + 128, :3] / 255.0
        expected = skimage.transform.resize(photo, (16, 16), anti_aliasing=True)
        assert task.shape == (16, 16, 3)
        assert np.allclose(task.image().numpy(), expected, atol=1e-6)
    assert [c.name for c in photo_crops(12, size=16, seed=3)] == [c.name for c in crops]
    assert [c.name for c in photo_crops(12, size=16, seed=4)] != [c.name for c in crops]
    with pytest.raises(ValueError, match="the photos hold"):
        photo_crops(10_000)


def test_image_folder_round_trips(tmp_path: Path) -> None:
    sources = {"b": _random_rgb(1), "a": _random_rgb(2, 4, 6)}
    for name, pixels in sources.items():
        _save(tmp_path / f"{name}.png", pixels)
    (tmp_path / "notes.txt").write_text("not an image")
    tasks = image_folder(tmp_path)
    assert [task.name for task in tasks] == ["a", "b"]
    for task in tasks:
        expected = torch.from_numpy(sources[task.name]).float() / 255
        assert torch.equal(task.image(), expected)
    grey = image_folder(tmp_path, size=4, grey=True)
    assert [task.shape for task in grey] == [(4, 4, 1), (4, 4, 1)]


def test_image_folder_errors_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}.*has no images"):
        image_folder(tmp_path)
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=f"{re.escape(str(missing))}.*does not exist"):
        image_folder(missing)


def test_gif_video_matches_frames_read_with_pil() -> None:
    assert SKIMAGE_GIF.is_file()
    with Image.open(SKIMAGE_GIF) as gif:
        frames = np.stack([np.array(frame.convert("RGB")) for frame in ImageSequence.Iterator(gif)])
    video = gif_video()
    assert video.shape == (24, *frames.shape[1:]) and video.coords.shape == (frames.size // 3, 3)
    assert torch.equal(video.frames(), torch.from_numpy(frames).float() / 255)
    assert video.coords.min() == -1 and video.coords.max() == 1
    short = gif_video(size=8, max_frames=5)
    assert short.shape == (5, 8, 8, 3)


def test_frame_folder_round_trips_and_rejects_mismatched_sizes(tmp_path: Path) -> None:
    frames = [_random_rgb(seed) for seed in range(3)]
    for index, pixels in enumerate(frames):
        _save(tmp_path / f"frame_{index:02d}.png", pixels)
    video = frame_folder(tmp_path)
    assert isinstance(video, VideoTask) and video.shape == (3, 5, 7, 3)
    assert torch.equal(video.frames(), torch.from_numpy(np.stack(frames)).float() / 255)
    odd = tmp_path / "frame_03.png"
    _save(odd, _random_rgb(9, 6, 7))
    with pytest.raises(ValueError, match=f"frame {re.escape(str(odd))} is 7x6"):
        frame_folder(tmp_path)


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_client_tasks_cover_every_task_once(partition: str) -> None:
    tasks = [f"task_{index}" for index in range(23)]
    clients = client_tasks(tasks, num_clients=5, seed=0, partition=partition, alpha=0.3)
    assert len(clients) == 5 and all(clients)
    assert sorted(task for client in clients for task in client) == sorted(tasks)
    assert client_tasks(tasks, 5, seed=0, partition=partition, alpha=0.3) == clients
    others = [client_tasks(tasks, 5, seed, partition, alpha=0.3) for seed in (1, 2, 3)]
    assert any(other != clients for other in others)


def test_client_tasks_rejects_unknown_partition() -> None:
    with pytest.raises(ValueError, match="'shards'"):
        client_tasks(["a", "b"], 2, seed=0, partition="shards")
