"""Object collections: distinct objects, white backgrounds, support/query tags, loader splits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfields.cli import main
from fedfields.data import load_scene
from fedfields.data.objects import CollectionConfig, write_collection
from fedfields.geometry.cameras import look_at


def test_look_at_points_the_camera_axis_at_the_target() -> None:
    position = torch.tensor([1.0, -2.0, 1.5])
    matrix = look_at(position, torch.zeros(3))
    rotation = matrix[:3, :3]
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(3), atol=1e-6, rtol=0)
    assert float(torch.linalg.det(rotation)) == pytest.approx(1.0, abs=1e-6)
    forward = -rotation[:, 2]  # OpenGL cameras look down -z
    torch.testing.assert_close(forward, -position / position.norm(), atol=1e-6, rtol=0)
    assert float(rotation[2, 1]) > 0  # image up points up the world z axis


@pytest.fixture(scope="module")
def collection(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("objects") / "collection"
    config = CollectionConfig(count=4, views=10, resolution=24, alpha=1.0, seed=5)
    return out, write_collection(config, out, progress=False)


def test_support_and_query_tags_follow_the_drawn_counts(collection) -> None:
    out, summary = collection
    supports, queries = [], []
    for entry in summary["objects"]:
        folder = out / entry["folder"]
        support = load_scene(folder, split="support")
        query = load_scene(folder, split="query")
        assert (len(support), len(query)) == (entry["support"], entry["query"])
        assert set(support.image_paths).isdisjoint(query.image_paths)
        supports.append(len(support))
        queries.append(len(query))
    assert sum(supports) == 4 * 4 and sum(queries) == 4 * 4  # FedMeNF mean 4 + 4


def test_objects_are_distinct_on_white_with_depth(collection) -> None:
    out, summary = collection
    images = []
    for entry in summary["objects"]:
        scene = load_scene(out / entry["folder"])
        assert len(scene) == 10 and scene.cameras.width == 24
        background = scene.masks == 0
        assert bool(background.any()) and bool((scene.masks == 1).any())
        assert bool((scene.images[background] == 1.0).all())  # white where nothing was hit
        meta = json.loads((out / entry["folder"] / "transforms.json").read_text())
        depth = np.load(out / entry["folder"] / meta["frames"][0]["depth_path"])
        hit = scene.masks[0].numpy() > 0
        assert np.isfinite(depth[hit]).all() and np.isinf(depth[~hit]).all()
        assert (depth[hit] > 3.0 - 1.0).all() and (depth[hit] < 3.0 + 1.0).all()
        images.append(scene.images[0])
    for i in range(len(images)):
        for j in range(i + 1, len(images)):
            assert float((images[i] - images[j]).abs().mean()) > 0.01


def test_same_seed_same_collection(tmp_path: Path, collection) -> None:
    out, summary = collection
    again = write_collection(
        CollectionConfig(count=4, views=10, resolution=24, alpha=1.0, seed=5),
        tmp_path / "again",
        progress=False,
    )
    assert again["objects"] == summary["objects"]
    first = load_scene(out / "object_002").images
    torch.testing.assert_close(load_scene(tmp_path / "again" / "object_002").images, first)


def test_cli_objects_and_bad_values(tmp_path: Path, capsys) -> None:
    out = tmp_path / "objs"
    args = ["data", "objects", "--count", "2", "--views", "8", "--resolution", "16"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["collection.json", "object_000", "object_001"]
    bad = ["data", "objects", "--count", "2", "--views", "1", "--out", str(tmp_path / "b")]
    assert main(bad) == 2
    assert "views must be >= 2" in capsys.readouterr().err
    assert main([*args, "--out", str(out), "--no-progress"]) == 2  # never overwrite
    assert "not empty" in capsys.readouterr().err
