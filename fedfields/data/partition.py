"""Seeded partitions of views, images or tasks into per-user groups for federated simulations.

Every partitioner takes an integer `seed`, returns the same `Partition` for the same seed,
and raises one `ValueError` naming the offending value when the request cannot be met.
View partitions (`direction_clusters`, `yaw_sectors`) work on unit viewing directions as
returned by `viewing_directions` and record each group's angular spread for `stats()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DEFAULT_RESTARTS = 16  # k-means restarts in direction_clusters
MAX_ITERATIONS = 50  # Lloyd iterations per restart; lego converges in under 10


@dataclass(frozen=True)
class Partition:
    """Groups of item indices (one sorted tuple per user) and how they were drawn.

    `left_out` lists items no group received; `spreads_deg` is each group's mean pairwise
    angle between viewing directions, present only for view partitions.
    """

    groups: tuple[tuple[int, ...], ...]
    method: str
    left_out: tuple[int, ...] = ()
    spreads_deg: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return len(self.groups)

    def stats(self) -> dict[str, Any]:
        """Group count, min/mean/max group size, items used and left out, spreads if known."""
        sizes = [len(group) for group in self.groups]
        stats: dict[str, Any] = {
            "method": self.method,
            "num_groups": len(sizes),
            "min_size": min(sizes),
            "mean_size": float(np.mean(sizes)),
            "max_size": max(sizes),
            "num_items": sum(sizes),
            "num_left_out": len(self.left_out),
        }
        if self.spreads_deg is not None:
            stats["mean_spread_deg"] = float(np.mean(self.spreads_deg))
            stats["max_spread_deg"] = float(np.max(self.spreads_deg))
        return stats

    def to_json(self) -> dict[str, Any]:
        """Plain lists and numbers, ready for `json.dump`."""
        return {
            "method": self.method,
            "groups": [list(group) for group in self.groups],
            "left_out": list(self.left_out),
            "stats": self.stats(),
        }


def viewing_directions(
    camera_to_world: np.ndarray | torch.Tensor,
    centre: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> np.ndarray:
    """Unit vectors [N, 3] from `centre` to each camera: the directions the scene is seen from."""
    if isinstance(camera_to_world, torch.Tensor):
        camera_to_world = camera_to_world.detach().cpu().numpy()
    poses = np.asarray(camera_to_world, dtype=np.float64)
    if poses.ndim != 3 or poses.shape[1:] not in ((4, 4), (3, 4)):
        raise ValueError(f"camera_to_world must be [N, 4, 4] or [N, 3, 4], got {poses.shape}")
    offsets = poses[:, :3, 3] - np.asarray(centre, dtype=np.float64)
    distances = np.linalg.norm(offsets, axis=1)
    if np.any(distances < 1e-9):
        camera = int(np.argmin(distances))
        raise ValueError(f"camera {camera} sits at the centre {centre}; it has no direction")
    return offsets / distances[:, None]


def direction_clusters(
    directions: np.ndarray,
    num_users: int,
    views_per_user: int,
    seed: int,
    *,
    restarts: int = DEFAULT_RESTARTS,
) -> Partition:
    """Balanced spherical k-means: `num_users` groups of exactly `views_per_user` nearby views.

    Each restart seeds centres by k-means++ and alternates a min-cost balanced assignment
    (`linear_sum_assignment` with each centre replicated `views_per_user` times, cost
    1 - cos) with moving each centre to its group's mean direction; the restart with the
    lowest total cost wins. When there are more views than needed, the assignment leaves
    out the views that are costliest to place (those farthest from every centre).
    Groups are ordered by the yaw of their centre, so neighbouring users see nearby sides.
    """
    units = _unit_directions(directions)
    _check_views(len(units), num_users, views_per_user)
    _check_positive("restarts", restarts)
    rng = np.random.default_rng(seed)
    runs = [_balanced_kmeans(units, num_users, views_per_user, rng) for _ in range(restarts)]
    _, labels, centres = min(runs, key=lambda run: run[0])
    order = np.argsort(np.arctan2(centres[:, 1], centres[:, 0]), kind="stable")
    groups = tuple(tuple(np.flatnonzero(labels == user).tolist()) for user in order)
    left_out = tuple(np.flatnonzero(labels < 0).tolist())
    return _view_partition(groups, "direction_clusters", units, left_out)


def yaw_sectors(
    directions: np.ndarray, num_users: int, views_per_user: int, seed: int
) -> Partition:
    """DecentNeRF's turntable split: consecutive runs of `views_per_user` views in yaw order.

    Yaw is atan2(y, x) about the world z axis, swept from a seeded random start angle.
    With more views than needed, the runs start at evenly spaced positions of the sweep, so
    the left-out views fall between sectors instead of in one gap.
    """
    units = _unit_directions(directions)
    _check_views(len(units), num_users, views_per_user)
    offset = np.random.default_rng(seed).uniform(0.0, 2.0 * math.pi)
    yaw = np.mod(np.arctan2(units[:, 1], units[:, 0]) - offset, 2.0 * math.pi)
    sweep = np.argsort(yaw, kind="stable")
    starts = [user * len(units) // num_users for user in range(num_users)]
    groups = tuple(
        tuple(sorted(sweep[start : start + views_per_user].tolist())) for start in starts
    )
    used = {index for group in groups for index in group}
    left_out = tuple(index for index in range(len(units)) if index not in used)
    return _view_partition(groups, "yaw_sectors", units, left_out)


def random_partition(num_items: int, num_users: int, per_user: int | None, seed: int) -> Partition:
    """IID split: a seeded permutation cut into groups of `per_user` items.

    `per_user=None` splits all items as evenly as possible (sizes differ by at most one).
    """
    _check_positive("num_items", num_items)
    _check_positive("num_users", num_users)
    if num_users > num_items:
        raise ValueError(f"{num_users} users need at least {num_users} items, got {num_items}")
    permutation = np.random.default_rng(seed).permutation(num_items)
    if per_user is None:
        chunks = np.array_split(permutation, num_users)
        left_out: tuple[int, ...] = ()
    else:
        _check_positive("per_user", per_user)
        if num_users * per_user > num_items:
            raise ValueError(
                f"{num_users} users x {per_user} items needs {num_users * per_user} items, "
                f"got {num_items}"
            )
        chunks = np.split(permutation[: num_users * per_user], num_users)
        left_out = tuple(sorted(permutation[num_users * per_user :].tolist()))
    groups = tuple(tuple(sorted(chunk.tolist())) for chunk in chunks)
    return Partition(groups=groups, method="random", left_out=left_out)


def dirichlet_partition(
    num_items: int, num_users: int, alpha: float, seed: int, min_size: int = 1
) -> Partition:
    """Non-IID quantity skew: group sizes follow Dirichlet(alpha); every item used exactly once.

    Small `alpha` concentrates items on few users; every group still gets `min_size` items.
    """
    sizes = dirichlet_counts(num_users, num_items, alpha, seed, minimum=min_size)
    permutation = np.random.default_rng([seed, 1]).permutation(num_items)
    chunks = np.split(permutation, np.cumsum(sizes)[:-1])
    groups = tuple(tuple(sorted(chunk.tolist())) for chunk in chunks)
    return Partition(groups=groups, method=f"dirichlet(alpha={alpha:g})")


def dirichlet_counts(
    num_tasks: int,
    total: int,
    alpha: float,
    seed: int,
    minimum: int = 1,
    maximum: int | None = None,
) -> np.ndarray:
    """Integer counts [num_tasks] summing to `total`, proportional to a Dirichlet(alpha) draw.

    Each count lies in [minimum, maximum]: the minimum is given first, the rest is split by
    the drawn proportions (capped counts pass their excess on) and rounded by largest
    remainder. Used e.g. for how many support and query views each object gets.
    """
    _check_positive("num_tasks", num_tasks)
    if not alpha > 0 or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a positive number, got {alpha}")
    if minimum < 0:
        raise ValueError(f"minimum must be >= 0, got {minimum}")
    if maximum is not None and maximum < minimum:
        raise ValueError(f"maximum {maximum} is below minimum {minimum}")
    if num_tasks * minimum > total:
        raise ValueError(
            f"{num_tasks} tasks x minimum {minimum} needs total >= {num_tasks * minimum}, "
            f"got {total}"
        )
    if maximum is not None and num_tasks * maximum < total:
        raise ValueError(
            f"{num_tasks} tasks x maximum {maximum} holds at most {num_tasks * maximum}, "
            f"total is {total}"
        )
    proportions = np.random.default_rng(seed).dirichlet(np.full(num_tasks, float(alpha)))
    free = total - num_tasks * minimum
    capacity = np.full(num_tasks, np.inf if maximum is None else float(maximum - minimum))
    shares = _water_fill(proportions, float(free), capacity)
    extra = np.minimum(np.floor(shares), capacity).astype(np.int64)
    remainder = free - int(extra.sum())
    fractions = np.where(extra < capacity, shares - extra, -np.inf)
    extra[np.argsort(-fractions, kind="stable")[:remainder]] += 1
    return extra + minimum


def support_query_split(
    num_items: int, num_support: int, num_query: int, seed: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Disjoint seeded (support, query) index tuples, each sorted, for meta-learning tasks."""
    _check_positive("num_items", num_items)
    if num_support < 0 or num_query < 0:
        raise ValueError(f"support and query sizes must be >= 0, got {num_support}, {num_query}")
    if num_support + num_query > num_items:
        raise ValueError(
            f"{num_support} support + {num_query} query views needs "
            f"{num_support + num_query} items, got {num_items}"
        )
    permutation = np.random.default_rng(seed).permutation(num_items)
    support = tuple(sorted(permutation[:num_support].tolist()))
    query = tuple(sorted(permutation[num_support : num_support + num_query].tolist()))
    return support, query


def mean_pairwise_angle_deg(directions: np.ndarray) -> float:
    """Mean angle in degrees over all pairs of unit directions [M, 3]; 0 for fewer than two."""
    if len(directions) < 2:
        return 0.0
    cosines = np.clip(directions @ directions.T, -1.0, 1.0)
    upper = np.triu_indices(len(directions), k=1)
    return float(np.degrees(np.arccos(cosines[upper])).mean())


def _view_partition(
    groups: tuple[tuple[int, ...], ...],
    method: str,
    units: np.ndarray,
    left_out: tuple[int, ...],
) -> Partition:
    spreads = tuple(mean_pairwise_angle_deg(units[list(group)]) for group in groups)
    return Partition(groups=groups, method=method, left_out=left_out, spreads_deg=spreads)


def _balanced_kmeans(
    units: np.ndarray, k: int, per_centre: int, rng: np.random.Generator
) -> tuple[float, np.ndarray, np.ndarray]:
    """One restart: (total cost, labels [N], centres [k, 3]) after Lloyd steps to a fixed point."""
    centres = _kmeans_plus_plus(units, k, rng)
    labels, cost = _balanced_assignment(units, centres, per_centre)
    for _ in range(MAX_ITERATIONS):
        centres = _mean_directions(units, labels, k)
        new_labels, cost = _balanced_assignment(units, centres, per_centre)
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
    return cost, labels, centres


def _kmeans_plus_plus(units: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ centres on the sphere, sampling with weight 1 - cos to the nearest centre."""
    centres = [units[rng.integers(len(units))]]
    for _ in range(1, k):
        distance = 1.0 - np.max(units @ np.stack(centres).T, axis=1)
        weights = np.clip(distance, 0.0, None)
        total = weights.sum()
        probabilities = weights / total if total > 0 else None
        centres.append(units[rng.choice(len(units), p=probabilities)])
    return np.stack(centres)


def _balanced_assignment(
    units: np.ndarray, centres: np.ndarray, per_centre: int
) -> tuple[np.ndarray, float]:
    """Labels [N] (-1 = left out) giving each centre exactly `per_centre` views at least cost."""
    from scipy.optimize import linear_sum_assignment  # 0.13 s: only crowd building needs it

    cost = 1.0 - units @ centres.T  # [N, K]
    slots = np.repeat(cost, per_centre, axis=1)  # [N, K * per_centre]
    rows, columns = linear_sum_assignment(slots)
    labels = np.full(len(units), -1)
    labels[rows] = columns // per_centre
    return labels, float(slots[rows, columns].sum())


def _mean_directions(units: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Each group's normalised mean direction (the spherical k-means centre update)."""
    sums = np.zeros((k, 3))
    np.add.at(sums, labels[labels >= 0], units[labels >= 0])
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    return sums / np.maximum(norms, 1e-12)


def _water_fill(proportions: np.ndarray, amount: float, capacity: np.ndarray) -> np.ndarray:
    """Split `amount` by `proportions`, capping each share at `capacity` and re-splitting excess."""
    shares = np.zeros_like(proportions)
    full = np.zeros(len(proportions), dtype=bool)
    while not full.all():
        rest = amount - shares[full].sum()
        weights = np.where(full, 0.0, proportions)
        if weights.sum() <= 0:  # tiny alpha can underflow every open proportion to zero
            weights = (~full).astype(np.float64)
        shares = np.where(full, shares, rest * weights / weights.sum())
        over = ~full & (shares > capacity)
        if not over.any():
            break
        shares[over] = capacity[over]
        full |= over
    return shares


def _unit_directions(directions: np.ndarray) -> np.ndarray:
    array = np.asarray(directions, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != 3:
        raise ValueError(f"directions must be [N, 3], got {array.shape}")
    norms = np.linalg.norm(array, axis=1)
    if not np.all(np.isfinite(norms)) or np.any(norms < 1e-9):
        raise ValueError("directions must be finite and non-zero")
    return array / norms[:, None]


def _check_views(num_views: int, num_users: int, views_per_user: int) -> None:
    _check_positive("num_users", num_users)
    _check_positive("views_per_user", views_per_user)
    needed = num_users * views_per_user
    if needed > num_views:
        raise ValueError(
            f"{num_users} users x {views_per_user} views needs {needed} views, "
            f"scene has {num_views}"
        )


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
