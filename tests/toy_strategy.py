"""docs/LIBRARY.md's example strategy as one module: a FedAvg whose clients read "toy-mu".

tests/test_strategies.py adds it to the App with one registry line and runs it through the
App's schema, builder and an in-process federation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

from fedfields.flower import FedAvg
from fedfields.flower.fedavg import FedAvgOptions
from fedfields.methods.settings import NON_NEGATIVE, StrategySettings, setting


@dataclass(frozen=True)
class FedToySettings(StrategySettings):
    """FedToy's run-config key; its server step is FedAvg's mean, so robust rules apply."""

    robust_rules = True
    mu: float = setting(0.25, "toy-mu", "FedToy's client weight mu", NON_NEGATIVE)


class FedToy(FedAvg):
    """FedAvg that sends its clients "toy-mu"."""

    strategy_name = "fedtoy"
    settings_class = FedToySettings

    def __init__(self, *, mu: float = 0.0, **options: Unpack[FedAvgOptions]) -> None:
        super().__init__(**options)
        self.mu = mu

    def protocol_config(self) -> dict[str, int | float | str]:
        """FedAvg's entries plus "toy-mu"."""
        return {**super().protocol_config(), "toy-mu": self.mu}
