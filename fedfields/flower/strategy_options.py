"""The options every fedfields strategy takes (`StrategyOptions`), their defaults and checks.

The reply caps bound what one client can do to a round: `max_num_examples` its weight,
`max_update_norm` how far its update may move the model; 0 or None lifts a cap.
"""

from __future__ import annotations

import math
from typing import TypedDict

from fedfields.compression import CompressionConfig
from fedfields.privacy.dp import DPConfig
from fedfields.privacy.secure_sum import SecureAggregationConfig


class StrategyOptions(TypedDict, total=False):
    """Constructor arguments every fedfields strategy takes (see `ProtocolStrategy`)."""

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    local_steps: int | None
    secure_aggregation: SecureAggregationConfig | None
    node_timeout: float | None
    max_num_examples: float | None
    max_update_norm: float | None
    max_empty_rounds: int
    sampling_seed: int | None
    sample_by_user: bool
    differential_privacy: DPConfig | None
    compression: CompressionConfig | None


DEFAULT_MAX_NUM_EXAMPLES = 1e9
"""Cap on a reply's "num-examples": a thousand megapixel photos, far above any client here,
yet low enough that one client cannot outweigh the others a billion to one."""
DEFAULT_MAX_UPDATE_NORM = 1e3
"""Cap on ||g_k - g|| / max(||g||, 1): an honest round moves a model by far less than 1000x
its own norm; a scaled or exploded update does not."""


def optional_cap(value: float | None, name: str) -> float | None:
    """A positive finite cap, or None for 0/None (no cap); ValueError otherwise."""
    if value is None or (not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0 and finite (0 or None: no cap), got {value!r}")
    return float(value)


DEFAULT_MAX_EMPTY_ROUNDS = 3
"""Consecutive rounds without an aggregate that end a run: one empty round is a bad moment,
three in a row a federation that cannot train as configured."""


def check_max_empty_rounds(value: object) -> int:
    """`value` as max_empty_rounds: an integer >= 0 (0: no limit); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"max_empty_rounds must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"max_empty_rounds must be >= 0 (0: no limit), got {value}")
    return value


DEFAULT_LOCAL_STEPS = 1
""""local-steps" when neither the strategy nor the user's train config sets it."""


def check_local_steps(value: object, name: str) -> None:
    """Raise ValueError unless `value` is a positive int (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
