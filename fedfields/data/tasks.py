"""Image and video fitting tasks for SIREN-style fields: pixel colours at grid coordinates.

A task pairs every pixel with its coordinate in [-1, 1] (row-major, the pixel order of
`array.reshape(-1, C)`), so a field maps coords -> pixels and `image()` / `frames()` put
the pixels back in their grid. Loaders read scikit-image's bundled data, image folders
and GIFs; `client_tasks` deals tasks out to federated clients with `fedfields.data.partition`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import skimage.color
import skimage.data
import torch
from PIL import Image, ImageSequence

from fedfields.data.partition import dirichlet_partition, random_partition

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
SKIMAGE_IMAGES = (
    "astronaut",
    "camera",
    "chelsea",
    "coffee",
    "rocket",
    "retina",
    "hubble_deep_field",
)
SKIMAGE_GIF = Path(skimage.data.__file__).parent / "no_time_for_that_tiny.gif"  # 24 RGB frames
LFW_FACES = 100  # lfw_subset(): the first 100 of its 200 crops are faces, the rest background
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field")
"""scikit-image's bundled colour photographs that `photo_crops` cuts its crops from."""

Task = TypeVar("Task")


@dataclass(frozen=True)
class ImageTask:
    """One image: `coords` [H*W, 2] as (row, col) in [-1, 1], `pixels` [H*W, C] in [0, 1]."""

    name: str
    coords: torch.Tensor  # [H*W, 2] float32, (row, col); (-1, -1) is the top-left pixel
    pixels: torch.Tensor  # [H*W, C] float32 in [0, 1], row-major
    shape: tuple[int, int, int]  # (H, W, C)

    def __post_init__(self) -> None:
        _check_task(self.name, self.coords, self.pixels, self.shape)

    @classmethod
    def from_array(cls, name: str, array: np.ndarray) -> ImageTask:
        """Task from an [H, W] or [H, W, C] array: uint8 is divided by 255, floats kept."""
        image = _as_float32(array)
        if image.ndim == 2:
            image = image[..., None]
        if image.ndim != 3:
            raise ValueError(f"image {name!r} must be [H, W] or [H, W, C], got {array.shape}")
        height, width, channels = image.shape
        return cls(
            name=name,
            coords=coordinate_grid((height, width)),
            pixels=torch.from_numpy(np.ascontiguousarray(image.reshape(-1, channels))),
            shape=(height, width, channels),
        )

    def image(self) -> torch.Tensor:
        """The pixels as an [H, W, C] image."""
        return self.pixels.reshape(self.shape)


@dataclass(frozen=True)
class VideoTask:
    """A clip: `coords` [T*H*W, 3] as (t, row, col) in [-1, 1], `pixels` [T*H*W, C] in [0, 1]."""

    name: str
    coords: torch.Tensor  # [T*H*W, 3] float32, (t, row, col)
    pixels: torch.Tensor  # [T*H*W, C] float32 in [0, 1], frame-major then row-major
    shape: tuple[int, int, int, int]  # (T, H, W, C)

    def __post_init__(self) -> None:
        _check_task(self.name, self.coords, self.pixels, self.shape)

    @classmethod
    def from_frames(cls, name: str, frames: np.ndarray) -> VideoTask:
        """Task from [T, H, W] or [T, H, W, C] frames: uint8 is divided by 255, floats kept."""
        video = _as_float32(frames)
        if video.ndim == 3:
            video = video[..., None]
        if video.ndim != 4:
            raise ValueError(
                f"video {name!r} must be [T, H, W] or [T, H, W, C], got {frames.shape}"
            )
        num_frames, height, width, channels = video.shape
        return cls(
            name=name,
            coords=coordinate_grid((num_frames, height, width)),
            pixels=torch.from_numpy(np.ascontiguousarray(video.reshape(-1, channels))),
            shape=(num_frames, height, width, channels),
        )

    def frames(self) -> torch.Tensor:
        """The pixels as [T, H, W, C] frames."""
        return self.pixels.reshape(self.shape)


def coordinate_grid(shape: Sequence[int]) -> torch.Tensor:
    """Row-major grid [prod(shape), len(shape)] of coordinates, each axis linspace(-1, 1).

    Row i matches pixel i of `array.reshape(-1, C)`; an axis of length 1 sits at -1.
    """
    if len(shape) == 0 or any(size < 1 for size in shape):
        raise ValueError(f"grid shape must be non-empty positive sizes, got {tuple(shape)}")
    axes = [torch.linspace(-1.0, 1.0, size) for size in shape]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(shape))


def lfw_faces(count: int | None = None, size: int | None = None) -> list[ImageTask]:
    """Grey 25x25 face crops from `skimage.data.lfw_subset()` (its first 100 of 200 crops).

    The crops load as float64 in [0, 1] (its docstring says uint8); pixels keep those values
    as float32. `count` takes the first faces (all 100 when None); `size` resizes them.
    """
    if count is not None and not 1 <= count <= LFW_FACES:
        raise ValueError(f"lfw_subset has {LFW_FACES} faces, asked for {count}")
    faces = skimage.data.lfw_subset()[: LFW_FACES if count is None else count]
    return [
        ImageTask.from_array(f"lfw_face_{index:03d}", _fit(_as_float32(face)[..., None], size))
        for index, face in enumerate(faces)
    ]


def skimage_images(
    names: Sequence[str] = SKIMAGE_IMAGES, size: int | None = 64, grey: bool = False
) -> list[ImageTask]:
    """Images bundled with scikit-image, centre-cropped square and resized to `size`.

    Colour images keep RGB (alpha dropped) unless `grey`; grey images have one channel.
    """
    tasks = []
    for name in names:
        if name not in skimage.data.__all__:
            raise ValueError(f"skimage.data has no image {name!r}")
        image = _as_float32(getattr(skimage.data, name)())
        if image.ndim == 3:
            image = image[..., :3]
            image = skimage.color.rgb2gray(image).astype(np.float32) if grey else image
        image = image[..., None] if image.ndim == 2 else image
        tasks.append(ImageTask.from_array(name, _fit(image, size)))
    return tasks


def photo_crops(
    count: int, size: int = 64, crop: int = 128, seed: int = 0, names: Sequence[str] = PHOTOS
) -> list[ImageTask]:
    """`count` colour crops of `crop` x `crop` photo pixels resized to `size` x `size`.

    Crops are cells of a grid over each photo, so no two overlap (a held-out crop shares no
    pixel with a client's); photos take turns, each giving its cells in a `seed`-shuffled
    order until it runs out. Natural-image patches with more detail per pixel than the
    25x25 LFW faces, so a SIREN cannot memorise one in a few dozen steps.
    """
    if count < 1 or size < 1 or crop < size:
        raise ValueError(f"need count >= 1 and crop >= size >= 1, got {count}, {crop}, {size}")
    rng = np.random.default_rng(seed)
    photos, cells = [], []
    for name in names:
        photo = _as_float32(getattr(skimage.data, name)())
        if photo.ndim != 3 or photo.shape[-1] < 3:
            raise ValueError(f"skimage.data.{name} is not a colour photo")
        photos.append(photo[..., :3])
        grid = [(top, left) for top in range(0, photo.shape[0] - crop + 1, crop)
                for left in range(0, photo.shape[1] - crop + 1, crop)]  # fmt: skip
        cells.append([grid[i] for i in rng.permutation(len(grid))])
    available = sum(len(grid) for grid in cells)
    if count > available:
        raise ValueError(f"{count} crops of {crop} px asked; the photos hold {available}")
    tasks: list[ImageTask] = []
    turn = 0
    while len(tasks) < count:
        index = turn % len(names)
        turn += 1
        if cells[index]:
            top, left = cells[index].pop(0)
            patch = photos[index][top : top + crop, left : left + crop]
            tasks.append(ImageTask.from_array(f"{names[index]}_{top}_{left}", _fit(patch, size)))
    return tasks


def image_folder(path: str | Path, size: int | None = None, grey: bool = False) -> list[ImageTask]:
    """One task per image file in `path` (first frame of GIFs), sorted by file name.

    Images are read as RGB (alpha dropped) or, with `grey`, one channel; `size` centre-crops
    them square and resizes. Task names are the file stems.
    """
    files = _image_files(path, "image folder")
    return [
        ImageTask.from_array(file.stem, _fit(_as_float32(_read_image(file, grey)), size))
        for file in files
    ]


def gif_video(
    path: str | Path | None = None, size: int | None = None, max_frames: int | None = None
) -> VideoTask:
    """Every frame of a GIF as RGB; default scikit-image's 24-frame `no_time_for_that_tiny.gif`.

    `max_frames` keeps the first frames only; `size` centre-crops frames square and resizes.
    """
    path = Path(SKIMAGE_GIF if path is None else path)
    if not path.is_file():
        raise ValueError(f"GIF {path} does not exist")
    if max_frames is not None and max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    with Image.open(path) as gif:
        frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(gif)]
    frames = frames[:max_frames]
    return VideoTask.from_frames(path.stem, _fit(_as_float32(np.stack(frames)), size))


def frame_folder(path: str | Path, size: int | None = None) -> VideoTask:
    """A video from the image files in `path`, in file-name order; all frames share a size."""
    files = _image_files(path, "frame folder")
    frames = [_read_image(file, grey=False) for file in files]
    for file, frame in zip(files, frames, strict=True):
        if frame.shape != frames[0].shape:
            raise ValueError(
                f"frame {file} is {frame.shape[1]}x{frame.shape[0]}, but {files[0].name} is "
                f"{frames[0].shape[1]}x{frames[0].shape[0]}"
            )
    return VideoTask.from_frames(Path(path).name, _fit(_as_float32(np.stack(frames)), size))


def client_tasks(
    tasks: Sequence[Task],
    num_clients: int,
    seed: int,
    partition: str = "iid",
    alpha: float = 0.5,
) -> list[list[Task]]:
    """Deal `tasks` out to `num_clients` clients: "iid" (even random split) or "dirichlet".

    "dirichlet" draws how many tasks each client gets from Dirichlet(`alpha`), at least one.
    """
    if partition == "iid":
        split = random_partition(len(tasks), num_clients, None, seed)
    elif partition == "dirichlet":
        split = dirichlet_partition(len(tasks), num_clients, alpha, seed)
    else:
        raise ValueError(f"partition must be 'iid' or 'dirichlet', got {partition!r}")
    return [[tasks[index] for index in group] for group in split.groups]


def _image_files(path: str | Path, kind: str) -> list[Path]:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{kind} {folder} does not exist")
    files = sorted(
        (file for file in folder.iterdir() if file.suffix.lower() in IMAGE_SUFFIXES),
        key=lambda file: file.name,
    )
    if not files:
        raise ValueError(f"{kind} {folder} has no images ({', '.join(IMAGE_SUFFIXES)})")
    return files


def _read_image(file: Path, grey: bool) -> np.ndarray:
    """First frame of an image file as uint8 [H, W, 3], or [H, W, 1] when `grey`."""
    with Image.open(file) as image:
        image.seek(0)
        pixels = np.asarray(image.convert("L" if grey else "RGB"))
    return pixels[..., None] if grey else pixels


def _as_float32(array: np.ndarray) -> np.ndarray:
    """uint8 / 255 or bool as float32; float arrays must already lie in [0, 1]."""
    array = np.asarray(array)
    if array.dtype == np.uint8:
        return array.astype(np.float32) / np.float32(255)
    if array.dtype == np.bool_ or np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32)
    raise ValueError(f"pixels must be uint8, bool or float in [0, 1], got {array.dtype}")


def _fit(array: np.ndarray, size: int | None) -> np.ndarray:
    """Centre-crop [..., H, W, C] to a square and resize it to size x size (None: unchanged)."""
    import skimage.transform  # loads scipy.ndimage: only the meta tasks' photos need it

    if size is None:
        return array
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    height, width = array.shape[-3:-1]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    square = array[..., top : top + side, left : left + side, :]
    images = square.reshape(-1, side, side, square.shape[-1])
    resized = [
        skimage.transform.resize(image, (size, size), anti_aliasing=True) for image in images
    ]
    return np.stack(resized).reshape(*array.shape[:-3], size, size, -1).astype(np.float32)


def _check_task(
    name: str, coords: torch.Tensor, pixels: torch.Tensor, shape: tuple[int, ...]
) -> None:
    """Coords and pixels must have one row per grid point and the right widths."""
    points = math.prod(shape[:-1])
    if coords.shape != (points, len(shape) - 1) or pixels.shape != (points, shape[-1]):
        raise ValueError(
            f"task {name!r} of shape {shape} needs coords [{points}, {len(shape) - 1}] and "
            f"pixels [{points}, {shape[-1]}], got {tuple(coords.shape)} and {tuple(pixels.shape)}"
        )
