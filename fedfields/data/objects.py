"""Object collections for few-shot NeRF: one procedural object per client, a few views each.

FedMeNF's benchmarks give every client its own object (a car, a chair) seen from a handful of
views. We ray-cast procedural objects (`fedfields.data.figures`) from random directions on a
sphere, on white, and draw how many support and query views each object gets from a
Dirichlet distribution (FedMeNF: 4 + 4 on average); leftover views are tagged "test".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from fedfields.data.figures import random_object
from fedfields.data.partition import dirichlet_counts
from fedfields.data.surfaces import render_surfaces
from fedfields.geometry.cameras import CAMERA_ANGLE_X, orbit_cameras

COLLECTION_FORMAT = "fedfields-objects-1"


@dataclass(frozen=True)
class CollectionConfig:
    """How many objects, views and pixels, and how views are split into support and query."""

    count: int = 50
    views: int = 16
    resolution: int = 64
    alpha: float = 1.0  # Dirichlet concentration of the per-object view counts
    mean_support: int = 4
    mean_query: int = 4
    camera_distance: float = 3.0  # objects fit in the unit sphere
    elevation_range: tuple[float, float] = (-20.0, 80.0)  # degrees
    seed: int = 0

    def __post_init__(self) -> None:
        if self.count < 1 or self.resolution < 4:
            raise ValueError(
                f"need count >= 1 and resolution >= 4: {self.count}, {self.resolution}"
            )
        if self.views < 2:
            raise ValueError(f"views must be >= 2 (a support and a query view), got {self.views}")
        if self.mean_support + self.mean_query > self.views:
            raise ValueError(
                f"mean support {self.mean_support} + mean query {self.mean_query} views exceed "
                f"the {self.views} views rendered per object"
            )
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")


def split_counts(config: CollectionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(support, query) view counts per object from Dirichlet(alpha) shares of the totals."""
    half = config.views // 2
    seed = np.random.default_rng([config.seed, 1])
    support = dirichlet_counts(
        config.count,
        config.count * config.mean_support,
        config.alpha,
        int(seed.integers(2**31)),
        minimum=1,
        maximum=config.views - half,
    )
    query = dirichlet_counts(
        config.count,
        config.count * config.mean_query,
        config.alpha,
        int(seed.integers(2**31)),
        minimum=1,
        maximum=half,
    )
    return np.asarray(support), np.asarray(query)


def write_collection(config: CollectionConfig, out: Path, progress: bool = True) -> dict:
    """Render every object and write `out/object_NNN/transforms.json`; returns the summary.

    Frames carry "split": "support" | "query" | "test"; `load_scene(dir, split="support")`
    reads one of them. Output is staged and renamed into place, so nothing is half-written.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: output folder exists and is not empty")
    support, query = split_counts(config)
    staging = out.with_name(f".{out.name}.partial")
    staging.mkdir(parents=True, exist_ok=True)
    objects = []
    for index in tqdm(range(config.count), desc="objects", disable=not progress):
        rng = np.random.default_rng([config.seed, 0, index])
        figure = random_object(rng)
        cameras = orbit_cameras(
            rng, config.views, config.resolution, config.camera_distance, config.elevation_range
        )
        rendered = render_surfaces([figure], cameras)
        order = rng.permutation(config.views)
        tags = np.full(config.views, "test", dtype=object)
        tags[order[: support[index]]] = "support"
        tags[order[support[index] : support[index] + query[index]]] = "query"
        folder = staging / f"object_{index:03d}"
        (folder / "images").mkdir(parents=True, exist_ok=True)
        frames = []
        for view in range(config.views):
            rgba = rendered.rgba[view].clamp(0.0, 1.0).numpy()
            stem = f"r_{view:03d}"
            Image.fromarray((rgba * 255 + 0.5).astype(np.uint8), mode="RGBA").save(
                folder / "images" / f"{stem}.png"
            )
            np.save(folder / "images" / f"{stem}_depth.npy", rendered.depth[view].numpy())
            frames.append(
                {
                    "file_path": f"images/{stem}.png",
                    "depth_path": f"images/{stem}_depth.npy",
                    "split": str(tags[view]),
                    "transform_matrix": cameras.camera_to_world[view].tolist(),
                }
            )
        meta = {
            "camera_angle_x": CAMERA_ANGLE_X,
            "aabb": [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]],
            "near": config.camera_distance - 1.2,
            "far": config.camera_distance + 1.2,
            "object": {"index": index, "name": figure.name},
            "frames": frames,
        }
        (folder / "transforms.json").write_text(json.dumps(meta, indent=2))
        objects.append(
            {
                "folder": folder.name,
                "kind": figure.name,
                "support": int(support[index]),
                "query": int(query[index]),
            }
        )
    summary = {
        "format": COLLECTION_FORMAT,
        "config": asdict(config),
        "objects": objects,
        "support_views": _describe(support),
        "query_views": _describe(query),
    }
    (staging / "collection.json").write_text(json.dumps(summary, indent=2))
    if out.exists():
        out.rmdir()
    staging.rename(out)
    return summary


def _describe(counts: np.ndarray) -> dict[str, float]:
    """Min, mean and max of per-object view counts."""
    return {"min": int(counts.min()), "mean": float(counts.mean()), "max": int(counts.max())}
