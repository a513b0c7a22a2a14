"""The federated job's settings, read from Flower run-config (dash-case keys) and validated.

Both the ServerApp and the ClientApp build their global field from the same `FederatedConfig`
so the federated tensors agree; unknown keys and bad values fail with one clear error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from fedfields.data.scene import Scene
from fedfields.fields import HashGridConfig, HashGridField, HashGridFieldConfig
from fedfields.render import RenderConfig

STRATEGY_NAMES = ("decentnerf", "fedavg", "fedprox", "scaffold")


@dataclass(frozen=True)
class FederatedConfig:
    """Settings of one federated NeRF run; field names are the run-config keys in snake_case."""

    strategy: str = "decentnerf"
    num_server_rounds: int = 8
    local_steps: int = 32
    fraction_train: float = 0.5
    min_train_nodes: int = 2
    data_dir: str = ""  # absolute path of a `fedfields data crowd` dataset
    run_dir: str = ""  # "" -> runs/<time>-<strategy> under the working directory
    downscale: float = 1.0
    learning_rate: float = 1e-2
    personal_learning_rate: float = 1e-2
    target_samples: int = 1 << 14
    personal_density_weight: float = 0.01
    proximal_mu: float = 0.01
    alpha_lr: float = 0.1  # eta; alphas move ~0.01-0.1 per round on the default field
    scaffold_global_lr: float = 1.0
    hash_log2_size: int = 15
    eval_views_per_round: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(
                f"run-config 'strategy' must be one of {STRATEGY_NAMES}, got {self.strategy!r}"
            )
        for name in ("num_server_rounds", "local_steps", "min_train_nodes", "target_samples"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"run-config '{_dash(name)}' must be >= 1, got {getattr(self, name)}"
                )
        if not 0.0 < self.fraction_train <= 1.0:
            raise ValueError(
                f"run-config 'fraction-train' must be in (0, 1], got {self.fraction_train}"
            )
        if not 10 <= self.hash_log2_size <= 22:
            raise ValueError(
                f"run-config 'hash-log2-size' must be in [10, 22], got {self.hash_log2_size}"
            )
        for name in (
            "downscale",
            "learning_rate",
            "personal_learning_rate",
            "personal_density_weight",
            "proximal_mu",
            "alpha_lr",
            "scaffold_global_lr",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "downscale" and value == 0):
                raise ValueError(
                    f"run-config '{_dash(name)}' must be a finite number >= 0, got {value}"
                )

    def to_run_config(self) -> dict[str, Any]:
        """The dash-case run-config dict that `from_run_config` reads back."""
        return {_dash(key): value for key, value in asdict(self).items()}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Parse Flower's run-config; unknown keys and wrong types raise one ValueError."""
        known = {_dash(f.name): f for f in fields(cls)}
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            raise ValueError(f"unknown run-config keys {unknown}; known keys: {sorted(known)}")
        values = {}
        for key, value in run_config.items():
            expected = type(getattr(cls(), known[key].name))
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
                raise ValueError(f"run-config '{key}' must be {expected.__name__}, got {value!r}")
            values[known[key].name] = value
        return cls(**values)


def _dash(name: str) -> str:
    return name.replace("_", "-")


def global_field(config: FederatedConfig, scene: Scene) -> HashGridField:
    """The federated global field: an Instant-NGP hash grid over the scene's box and size.

    Server and clients build it from the same config and data, so their tensors agree.
    """
    resolution = max(scene.cameras.width, scene.cameras.height)
    encoding = HashGridConfig(
        max_resolution=max(64, 4 * resolution), log2_hashmap_size=config.hash_log2_size
    )
    aabb = tuple(scene.aabb.reshape(-1).tolist())
    return HashGridField(HashGridFieldConfig(encoding=encoding, aabb=aabb))


def render_config(scene: Scene) -> RenderConfig:
    """Occupancy-marching settings for the scene, shared by clients and the server."""
    extent = float((scene.aabb[1] - scene.aabb[0]).max())
    return RenderConfig(
        near=scene.near,
        far=scene.far,
        aabb=tuple(scene.aabb.reshape(-1).tolist()),
        background=scene.background,
        step_size=extent * math.sqrt(3) / 256,
    )
