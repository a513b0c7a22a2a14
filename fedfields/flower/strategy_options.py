"""The options every fedfields strategy takes (`StrategyOptions`), their defaults and checks,
and how a strategy's own train-config entries merge with the user's (`merged_train_config`).

The reply caps bound what one client can do to a round: `max_num_examples` its weight,
`max_update_norm` how far its update may move the model; 0 or None lifts a cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self, TypedDict, Unpack

from fedfields.compression import CompressionConfig
from fedfields.flower.protocol import LOCAL_STEPS, SERVER_ROUND
from fedfields.methods.settings import StrategySettings
from fedfields.privacy.dp import DPConfig
from fedfields.privacy.secagg_plan import SecureAggregationConfig


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


def merged_train_config(
    config: Mapping[str, Any], own: Mapping[str, Any], server_round: int
) -> dict[str, Any]:
    """The user's train `config` with the strategy's `own` entries and "server-round"; an own
    entry the user set to another value raises (set it through the strategy's constructor).

    "local-steps" comes from `own` if set, else from `config`, else `DEFAULT_LOCAL_STEPS`.
    """
    clashes = [
        f"{key!r}={config[key]!r} (strategy: {value!r})"
        for key, value in own.items()
        if key in config and config[key] != value
    ]
    if clashes:
        raise ValueError(
            "train_config sets entries the strategy owns; set them through the strategy's "
            f"constructor instead: {', '.join(clashes)}"
        )
    merged = {LOCAL_STEPS: DEFAULT_LOCAL_STEPS, **config, **own, SERVER_ROUND: server_round}
    check_local_steps(merged[LOCAL_STEPS], f"train config {LOCAL_STEPS!r}")
    return merged


def checked_compression(
    config: CompressionConfig | None,
    secure_aggregation: SecureAggregationConfig | None,
    privacy: DPConfig | None = None,
) -> CompressionConfig | None:
    """`config` if a strategy can take it (None for "none"); ValueError saying why not.

    SecAgg+ sums masked vectors entry by entry: quantised codes on the scale every client
    shares add up (`fedfields.privacy.packed_sum`), low-rank factors and top-k index sets of
    different clients do not, so they cannot be masked. Under distributed DP the noised shares
    are not coarsened to b bits (the accountant charges the noised sum itself).
    """
    if config is None or not config.enabled:
        return None
    if secure_aggregation is not None and config.scheme in ("lowrank", "topk"):
        raise ValueError(
            f"compression {config.scheme!r} cannot compose with secure aggregation: SecAgg+ "
            "sums masked vectors entry by entry, and clients' low-rank factors or top-k "
            "indices do not add up to those of the sum"
        )
    if secure_aggregation is not None and privacy is not None:
        raise ValueError(
            "compression 'quantise' with secure aggregation and differential privacy is "
            "refused: b-bit codes of each client's noise share are not the noised sum the "
            "accountant charges; use one or the other"
        )
    return config


class RunConfigured:
    """How a strategy is built from run-config: typed `settings` (the App's registry) or a
    Flower run-config's keys (your own app)."""

    settings_class: ClassVar[type[StrategySettings]] = StrategySettings
    """The strategy's own run-config keys, typed (`fedfields.methods.settings`)."""
    shared_keys: ClassVar[dict[str, str]] = {
        "max-num-examples": "max_num_examples",
        "max-update-norm": "max_update_norm",
        "max-empty-rounds": "max_empty_rounds",
    }
    """Run-config keys every strategy of this family takes (the App's schema keeps them in
    its sections) -> constructor arguments; `from_config` reads those of the bases too."""

    @classmethod
    def from_settings(cls, settings: StrategySettings, **options: Unpack[StrategyOptions]) -> Self:
        """The strategy with its typed run-config `settings` (an instance of
        `settings_class`) and the shared `options`: what the App's registry builds."""
        if not isinstance(settings, cls.settings_class):
            raise TypeError(
                f"{cls.__name__} takes {cls.settings_class.__name__}, got {type(settings).__name__}"
            )
        return cls(**settings.arguments(), **options)

    @classmethod
    def from_config(cls, run_config: Mapping[str, Any], **options: Unpack[StrategyOptions]) -> Self:
        """The strategy with its own settings from a Flower run-config (`settings_class`'s
        keys and `shared_keys`; absent keys keep the constructor's defaults) and the shared
        `options`; ValueError naming a key that misspells one of them, or a bad value."""
        cls.settings_class.refuse_misspelt(run_config)
        return cls(**cls.settings_class.given(run_config), **cls.shared_config(run_config),
                   **options)  # fmt: skip

    @classmethod
    def shared_config(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Constructor arguments from the run-config keys in `shared_keys` of this class and
        its bases (absent keys are left out, so they keep the defaults)."""
        keys: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            keys.update(vars(klass).get("shared_keys", {}))
        return {arg: run_config[key] for key, arg in keys.items() if key in run_config}
