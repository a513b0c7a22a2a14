"""docs/LIBRARY.md's example method as one module: FedAvg's mean, clients read "toy-mu".

tests/test_strategies.py adds it to the App with one registry line and runs it through the
App's schema, builder and an in-process federation.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfields.methods.base import Method
from fedfields.methods.settings import NON_NEGATIVE, StrategySettings, setting


@dataclass(frozen=True)
class FedToySettings(StrategySettings):
    """FedToy's run-config key; its server step is FedAvg's mean, so robust rules apply."""

    robust_rules = True
    mu: float = setting(0.25, "toy-mu", "FedToy's client weight mu", NON_NEGATIVE)


class FedToy(Method):
    """FedAvg's mean; the clients are sent "toy-mu"."""

    name = "fedtoy"
    settings_class = FedToySettings

    def __init__(self, *, mu: float = 0.0) -> None:
        self.mu = mu

    def client_config(self) -> dict[str, int | float | str]:
        """mu as "toy-mu"."""
        return {"toy-mu": self.mu}
