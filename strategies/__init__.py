"""This app's one registry of strategies: run-config `strategy` -> (class, settings class).

Adding a method: one module in `fedfields/methods/` (a `fedfields.methods.base.Method`
subclass with its `name` and, if it has run-config keys of its own, a `StrategySettings`
dataclass as its `settings_class`) and one line in `REGISTRY`; the schema, pyproject.toml and
docs/RUN_CONFIG.md read its keys from this registry (docs/LIBRARY.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Unpack

from fedfields.config import FederatedConfig
from fedfields.flower import (
    FedMeNF,
    MethodOptions,
    ProtocolStrategy,
    method_strategy,
)
from fedfields.methods import (
    decentnerf,
    fedacg,
    fedavg,
    fedavgm,
    fedexp,
    fednova,
    fedopt,
    fedprox,
    scaffold,
)
from fedfields.methods.base import Method
from fedfields.methods.settings import StrategySettings

REGISTRY: tuple[type[Method] | type[ProtocolStrategy], ...] = (
    fedavg.FedAvg,
    fedprox.FedProx,
    scaffold.Scaffold,
    fednova.FedNova,
    fedexp.FedExP,
    fedacg.FedACG,
    decentnerf.DecentNeRF,
    FedMeNF,
    fedavgm.FedAvgM,
    fedopt.FedAdam,
    fedopt.FedYogi,
    fedopt.FedAdagrad,
)
"""Every method of the App, in the order docs/RUN_CONFIG.md lists them: a `Method` (run
through `fedfields.flower.MethodStrategy`) or a Flower strategy class of its own."""


StrategyEntry = tuple[type[ProtocolStrategy], type[StrategySettings]]


def entry(registered: type[Method] | type[ProtocolStrategy]) -> StrategyEntry:
    """A registry line's strategy class and settings class."""
    cls = method_strategy(registered) if issubclass(registered, Method) else registered
    return cls, cls.settings_class


STRATEGIES: dict[str, StrategyEntry] = {
    cls.strategy_name: (cls, settings) for cls, settings in map(entry, REGISTRY)
}


def strategy_class(name: str) -> type[ProtocolStrategy]:
    """The class registered under `name`; ValueError naming the registered ones otherwise."""
    if name not in STRATEGIES:
        raise ValueError(
            f"run-config 'strategy' {name!r} is unknown; known: {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name][0]


def strategy_settings() -> dict[str, type[StrategySettings]]:
    """Each registered strategy's settings class: what the schema reads their keys from."""
    return {name: settings for name, (_, settings) in STRATEGIES.items()}


def parse_app_config(run_config: Mapping[str, Any]) -> FederatedConfig:
    """The App's one parse of a Flower run-config: the sections and every registered
    strategy's own keys (`FederatedConfig.from_run_config`)."""
    return FederatedConfig.from_run_config(run_config, strategy_settings())


def shared_options(config: FederatedConfig, cls: type[ProtocolStrategy]) -> dict[str, Any]:
    """The run-config's reply bounds for any strategy, and the robust rule for one whose
    server step starts from FedAvg's mean (`StrategySettings.robust_rules`)."""
    robust = config.robust
    options: dict[str, Any] = {
        "max_num_examples": robust.max_num_examples,
        "max_update_norm": robust.max_update_norm,
        "max_empty_rounds": robust.max_empty_rounds,
        "sample_by_user": True,  # the App's ClientApps answer the user-key query
    }
    if cls.settings_class.robust_rules:
        options |= {
            "aggregation_rule": robust.aggregation_rule,
            "trim_fraction": robust.trim_fraction,
            "num_malicious": robust.num_malicious,
            "krum_select": robust.krum_select,
        }
    return options


def make_strategy(config: FederatedConfig, **options: Unpack[MethodOptions]) -> ProtocolStrategy:
    """The run's strategy with its typed settings, the run-config's reply bounds and robust
    rule, and the `options` the job chooses (sampling, secure aggregation, DP)."""
    cls = strategy_class(config.strategy_name)
    settings = config.settings or cls.settings_class()
    return cls.from_settings(settings, **shared_options(config, cls), **options)
