"""Partitioners: seeded, exact coverage, bounds, errors, and tight view groups on real lego."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfields.data.partition import (
    Partition,
    direction_clusters,
    dirichlet_counts,
    dirichlet_partition,
    random_partition,
    support_query_split,
    viewing_directions,
    yaw_sectors,
)

LEGO_CAMERAS = Path(__file__).resolve().parents[1] / "data" / "lego" / "transforms_train.json"


def _sphere(count: int, seed: int = 0) -> np.ndarray:
    """Random unit directions on the upper hemisphere, like a turntable capture."""
    points = np.random.default_rng(seed).normal(size=(count, 3))
    points[:, 2] = np.abs(points[:, 2])
    return points / np.linalg.norm(points, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def lego_directions() -> np.ndarray:
    frames = json.loads(LEGO_CAMERAS.read_text())["frames"]
    return viewing_directions(np.array([frame["transform_matrix"] for frame in frames]))


def _mean_pairwise_angle(directions: np.ndarray) -> float:
    """Independent spread: mean angle in degrees over all distinct pairs."""
    angles = [
        np.degrees(np.arccos(np.clip(a @ b, -1.0, 1.0)))
        for i, a in enumerate(directions)
        for b in directions[i + 1 :]
    ]
    return float(np.mean(angles))


def _check_cover(partition: Partition, num_items: int, sizes: list[int]) -> None:
    """Groups sorted, disjoint, of the given sizes; with left_out they cover every item once."""
    assert [len(group) for group in partition.groups] == sizes
    assert all(list(group) == sorted(group) for group in partition.groups)
    used = [index for group in partition.groups for index in group] + list(partition.left_out)
    assert sorted(used) == list(range(num_items))


PARTITIONERS: dict[str, Callable[[int], Partition]] = {
    "direction_clusters": lambda seed: direction_clusters(_sphere(40), 6, 5, seed),
    "yaw_sectors": lambda seed: yaw_sectors(_sphere(40), 6, 5, seed),
    "random": lambda seed: random_partition(40, 6, 5, seed),
}


@pytest.mark.parametrize("name", PARTITIONERS)
def test_fixed_size_partitions_are_seeded_and_cover_exactly(name: str) -> None:
    make = PARTITIONERS[name]
    partition = make(0)
    _check_cover(partition, 40, [5] * 6)
    assert len(partition.left_out) == 10
    assert make(0) == partition
    assert any(make(seed).groups != partition.groups for seed in (1, 2, 3))


def test_random_partition_splits_all_items_evenly() -> None:
    partition = random_partition(23, 5, None, seed=3)
    sizes = [len(group) for group in partition.groups]
    _check_cover(partition, 23, sizes)
    assert max(sizes) - min(sizes) <= 1 and partition.left_out == ()


def test_dirichlet_partition_uses_every_item_once() -> None:
    partition = dirichlet_partition(100, 7, alpha=0.3, seed=5, min_size=2)
    sizes = [len(group) for group in partition.groups]
    _check_cover(partition, 100, sizes)
    assert min(sizes) >= 2 and partition.left_out == ()
    assert dirichlet_partition(100, 7, alpha=0.3, seed=5, min_size=2) == partition
    assert dirichlet_partition(100, 7, alpha=0.3, seed=6, min_size=2) != partition


@pytest.mark.parametrize(
    ("num_tasks", "total", "minimum", "maximum", "alpha"),
    [
        (50, 400, 1, None, 0.5),
        (50, 400, 2, 12, 0.1),
        (50, 200, 4, 4, 1.0),
        (5, 37, 0, 9, 0.01),
        (5, 60, 1, 50, 100.0),
    ],
)
def test_dirichlet_counts_sum_exactly_within_bounds(
    num_tasks: int, total: int, minimum: int, maximum: int | None, alpha: float
) -> None:
    for seed in range(20):
        counts = dirichlet_counts(num_tasks, total, alpha, seed, minimum, maximum)
        assert counts.shape == (num_tasks,) and counts.sum() == total
        assert counts.min() >= minimum and (maximum is None or counts.max() <= maximum)
    first = dirichlet_counts(num_tasks, total, alpha, 0, minimum, maximum)
    assert np.array_equal(first, dirichlet_counts(num_tasks, total, alpha, 0, minimum, maximum))


def test_small_alpha_is_more_skewed() -> None:
    def skew(alpha: float) -> float:
        return float(np.mean([dirichlet_counts(10, 400, alpha, seed).std() for seed in range(50)]))

    assert skew(0.1) > 2 * skew(1.0) > 4 * skew(100.0)


def test_support_query_split_is_disjoint_and_seeded() -> None:
    support, query = support_query_split(12, 4, 5, seed=0)
    assert len(support) == 4 and len(query) == 5 and not set(support) & set(query)
    assert list(support) == sorted(support) and list(query) == sorted(query)
    assert support_query_split(12, 4, 5, seed=0) == (support, query)
    assert any(support_query_split(12, 4, 5, seed) != (support, query) for seed in (1, 2, 3))


def test_viewing_directions_point_from_centre_to_cameras() -> None:
    poses = torch.eye(4).repeat(3, 1, 1)
    poses[:, :3, 3] = torch.tensor([[4.0, 0, 0], [0, 0, 2.0], [1.0, 1.0, 0]])
    directions = viewing_directions(poses, centre=(0.0, 0.0, 0.0))
    expected = np.array([[1, 0, 0], [0, 0, 1], [2**-0.5, 2**-0.5, 0]])
    np.testing.assert_allclose(directions, expected, atol=1e-7)
    np.testing.assert_allclose(viewing_directions(poses.numpy(), centre=(0, 0, 1))[1], [0, 0, 1])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: direction_clusters(_sphere(60), 16, 5, 0), "16 users x 5 views needs 80 views"),
        (lambda: yaw_sectors(_sphere(60), 16, 5, 0), "scene has 60"),
        (lambda: direction_clusters(_sphere(10)[:, :2], 2, 2, 0), r"\[N, 3\]"),
        (lambda: yaw_sectors(np.zeros((4, 3)), 2, 2, 0), "non-zero"),
        (lambda: random_partition(5, 6, None, 0), "6 users need at least 6 items"),
        (lambda: random_partition(10, 3, 4, 0), "needs 12 items, got 10"),
        (lambda: random_partition(10, 0, None, 0), "num_users"),
        (lambda: dirichlet_partition(5, 3, 0.5, 0, min_size=2), "needs total >= 6"),
        (lambda: dirichlet_counts(4, 10, 0.0, 0), "alpha"),
        (lambda: dirichlet_counts(4, 10, 0.5, 0, minimum=1, maximum=2), "holds at most 8"),
        (lambda: dirichlet_counts(4, 10, 0.5, 0, minimum=3, maximum=2), "below minimum"),
        (lambda: support_query_split(8, 5, 4, 0), "needs 9 items, got 8"),
        (lambda: viewing_directions(np.eye(4)[None]), "sits at the centre"),
    ],
)
def test_bad_input_raises_value_error(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_stats_and_json(lego_directions: np.ndarray) -> None:
    partition = direction_clusters(lego_directions, 10, 5, seed=0)
    stats = partition.stats()
    assert stats["num_groups"] == 10 and stats["min_size"] == stats["max_size"] == 5
    assert stats["num_items"] == 50 and stats["num_left_out"] == 30
    assert 0 < stats["mean_spread_deg"] <= stats["max_spread_deg"]
    assert json.loads(json.dumps(partition.to_json()))["groups"][0] == list(partition.groups[0])
    assert "mean_spread_deg" not in random_partition(10, 2, None, 0).stats()


def test_direction_clusters_are_tight_on_lego(lego_directions: np.ndarray) -> None:
    directions = lego_directions
    elevation = np.degrees(np.arcsin(directions[:, 2]))

    def spreads(partition: Partition) -> tuple[float, float]:
        _check_cover(partition, 80, [5] * 16)
        per_group = [_mean_pairwise_angle(directions[list(group)]) for group in partition.groups]
        elevation_range = max(np.ptp(elevation[list(group)]) for group in partition.groups)
        return float(np.mean(per_group)), float(elevation_range)

    clusters, clusters_elevation = spreads(direction_clusters(directions, 16, 5, seed=0))
    sectors, sectors_elevation = spreads(yaw_sectors(directions, 16, 5, seed=0))
    iid, _ = spreads(random_partition(80, 16, 5, seed=0))
    assert clusters < 0.7 * sectors and sectors < iid
    assert clusters_elevation < 0.6 * sectors_elevation
