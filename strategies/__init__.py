"""This app's one registry of strategy names: run-config `strategy` -> a fedfields.flower class.

Adding a strategy: one module in `fedfields/flower/` (a `ProtocolStrategy` subclass with its
`strategy_name` and `config_keys`) and one line here; its own run-config keys also need a
field in `fedfields/config/schema.py` and a line in pyproject.toml, and a strategy taking the
robust aggregation rules its name in the schema's ROBUST_STRATEGIES (docs/LIBRARY.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Unpack

from fedfields.flower import (
    DecentNeRF,
    FedACG,
    FedAvg,
    FedExP,
    FedMeNF,
    FedNova,
    FedProx,
    ProtocolStrategy,
    Scaffold,
    StrategyOptions,
)

STRATEGIES: dict[str, type[ProtocolStrategy]] = {
    cls.strategy_name: cls
    for cls in (FedAvg, FedProx, Scaffold, FedNova, FedExP, FedACG, DecentNeRF, FedMeNF)
}


def strategy_class(name: str) -> type[ProtocolStrategy]:
    """The class registered under `name`; ValueError naming the registered ones otherwise."""
    if name not in STRATEGIES:
        raise ValueError(
            f"run-config 'strategy' {name!r} is unknown; known: {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]


def make_strategy(
    name: str, run_config: Mapping[str, Any], **options: Unpack[StrategyOptions]
) -> ProtocolStrategy:
    """The strategy `name` with its own run-config settings and the shared `options`."""
    return strategy_class(name).from_config(run_config, **options)
