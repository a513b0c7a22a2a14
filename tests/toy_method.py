"""A toy method with a client half, added as docs/LIBRARY.md says: one module (this one) plus
one registry line (tests/test_methods.py adds it to the App's registry).

FedToyDecay's clients add weight/2 ||w||^2 to their loss (a `ClientHook` loss term) and reply
one more record, "toy-steps": every entry the number of local steps they took; the server
takes FedAvg's mean of ARRAYS from the round's sums and reports the mean of "toy-steps" over
the summed replies (weighted like ARRAYS) as "toy-mean-steps". Weight 0 is FedAvg.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedfields.methods.base import (
    ARRAYS,
    ClientHook,
    HookResult,
    Kept,
    Method,
    RecordSpec,
    RoundContext,
    RoundSums,
    ServerStep,
    State,
)
from fedfields.methods.settings import NON_NEGATIVE, StrategySettings, setting

TOY_WEIGHT = "toy-weight"
TOY_STEPS = "toy-steps"
MEAN_STEPS = "toy-mean-steps"


@dataclass(frozen=True)
class FedToyDecaySettings(StrategySettings):
    """FedToyDecay's run-config key."""

    weight: float = setting(0.0, TOY_WEIGHT, "FedToyDecay's client weight decay", NON_NEGATIVE)


class DecayHook(ClientHook):
    """weight/2 ||w||^2 on the trained parameters; replies the steps it saw as "toy-steps"."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.parameters: Mapping[str, Tensor] = {}

    def key(self) -> tuple[Any, ...]:
        return ("decay", self.weight)

    def bind(self, parameters: Mapping[str, Tensor]) -> None:
        self.parameters = parameters

    def loss(self) -> Tensor:
        squares = torch.stack([p.pow(2).sum() for p in self.parameters.values()]).sum()
        return 0.5 * self.weight * squares

    def finish(self, steps: int) -> HookResult:
        counts = {name: torch.full(p.shape, float(steps)) for name, p in self.parameters.items()}
        return HookResult(records={TOY_STEPS: counts})


class FedToyDecay(Method):
    """FedAvg's mean from the sums, and the summed replies' mean "toy-steps"."""

    name = "fedtoydecay"
    settings_class = FedToyDecaySettings
    from_mean = False

    def __init__(self, *, weight: float = 0.0) -> None:
        self.weight = weight

    def client_config(self) -> dict[str, int | float | str]:
        return {TOY_WEIGHT: self.weight}

    def reply_records(self) -> tuple[RecordSpec, ...]:
        return RecordSpec(ARRAYS), RecordSpec(TOY_STEPS, compressed=False)

    @classmethod
    def client_hooks(
        cls, config: Mapping[str, Any], received: Mapping[str, State], kept: Kept
    ) -> list[ClientHook]:
        return [DecayHook(float(config[TOY_WEIGHT]))]

    def step_from_sums(self, context: RoundContext, sums: RoundSums) -> ServerStep:
        mean = {
            key: (value / sums.weight).to(context.global_state[key].dtype)
            for key, value in sums.records[ARRAYS].items()
        }
        steps = torch.cat([v.reshape(-1) for v in sums.records[TOY_STEPS].values()])
        return ServerStep(mean, {MEAN_STEPS: float(steps.mean()) / sums.weight})
