"""What a method module declares, without Flower: its keys, records, server step and state.

Each method of this package is one module holding its `Method` subclass (or, for one paper's
family of rules, subclasses) next to its paper's equations. The generic round
(`fedfields.flower.method_strategy`) reads what the subclass declares and never names it:

- `name` and `settings_class`: the run-config value of "strategy" and the method's own
  run-config keys with their types, defaults and help (`fedfields.methods.settings`);
- `sent` and `reply_records`: what a train message carries (the global, a lookahead, a
  control variate) and what a reply carries, each reply record a
  `RecordSpec` (summed as a difference from what was sent or as it is, bounded by which check
  and cap, compressed or not);
- `secure_aggregation`, `differential_privacy`, `from_mean`: whether its server step reads
  only sums (so SecAgg+ and DP apply) and whether it starts from the replies' mean (which
  a robust rule may replace when its settings class allows `robust_rules`);
- the server step: `step_from_mean` over the round's mean, or `fold` (each checked reply as
  it arrives) and `step_from_sums` over the round's sums;
- `state` and `restore`: what a resumed run needs of it (moments, controls).

The record and metric names every method shares are defined here, so a method module needs
no Flower import (`fedfields.flower.protocol` re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from fedfields.methods.accounting import FEDAVG_COST, CostModel
from fedfields.methods.settings import StrategySettings

ARRAYS = "arrays"
"""Record of the global state a train message carries, and of the local state a reply does."""
CONFIG = "config"
METRICS = "metrics"
NUM_EXAMPLES = "num-examples"
"""Reply metric: the examples the client trained on (the mean's weight)."""
LOCAL_STEPS = "local-steps"
"""Train-config entry: the local optimisation steps a client runs this round."""
TRAIN_STEPS = "train-steps"
"""Train metric: the local optimiser steps the client took this round."""

State = dict[str, Tensor]


@dataclass(frozen=True)
class RecordSpec:
    """One record of a method's replies and how the round treats it.

    `delta`: summed as the reply's record minus the record sent under the same name (ARRAYS:
    y_k - g), in plaintext and under SecAgg+ alike. `norm_check` and `norm_cap`: a plaintext
    reply whose record has an L2 norm above `norm_cap` is dropped and counted under that
    check (None: no cap), for the reason `drop_reason` gives in a user's words.
    `compressed`: under compressed uploads the record travels compressed (ARRAYS as the
    update from what was sent, any other on its own)."""

    name: str
    delta: bool = False
    norm_check: str = ""
    norm_cap: float | None = None
    drop_reason: str = ""
    compressed: bool = True


@dataclass(frozen=True)
class RoundContext:
    """What a server step knows of its round: its number, the global x the round started from
    (float32 copies, before any lookahead), the train config sent, and N, the nodes connected
    when it was sampled."""

    server_round: int
    global_state: State
    sent_config: Mapping[str, Any]
    num_nodes_total: int


@dataclass(frozen=True)
class RoundSums:
    """The round's sums over its summed replies: per record sum_k w_k x_k (float64; `delta`
    records as differences from what was sent), sum_k w_k and how many replies were summed.
    Empty `records` when the method folded each reply itself (`Method.fold`)."""

    records: Mapping[str, Mapping[str, Tensor]]
    weight: float
    count: int


@dataclass(frozen=True)
class ServerStep:
    """A server step's result: the new global (None: none formed, the global stays) and the
    method's own train metrics for the round."""

    new_global: State | None
    metrics: dict[str, float] = field(default_factory=dict)


ReplyFold = Callable[[Mapping[str, Mapping[str, Tensor]], float, Mapping[str, float]], None]
"""A non-linear server step's intake of one checked reply: its records, its weight and the
scalars the method asked for (`Method.reply_scalars`)."""


class Method:
    """A federated method's server half: FedAvg's mean by default.

    Subclasses set `name` (and `settings_class` when they have run-config keys, whose fields
    are the constructor's keyword arguments) and override what differs from FedAvg.
    """

    name: ClassVar[str]
    settings_class: ClassVar[type[StrategySettings]] = StrategySettings
    cost_model: ClassVar[CostModel] = FEDAVG_COST
    """Server FLOPs and traffic per round (`fedfields.methods.accounting`)."""
    weight_metric: ClassVar[str] = NUM_EXAMPLES
    """The reply metric each reply's records are weighted by in the sum ("": 1)."""
    secure_aggregation: ClassVar[bool] = True
    """Whether the server step reads only the round's sums, so SecAgg+ can hide each reply."""
    differential_privacy: ClassVar[bool] = True
    """Whether the server step reads only a sum whose sensitivity clipping bounds (client DP)."""
    from_mean: ClassVar[bool] = True
    """Whether the step starts from the replies' mean (`step_from_mean`; a robust rule may
    replace that mean when `settings_class.robust_rules`); False: `fold`/`step_from_sums`."""

    def reply_records(self) -> tuple[RecordSpec, ...]:
        """The records a train reply carries, ARRAYS first, and how each is summed and bounded."""
        return (RecordSpec(ARRAYS),)

    def client_config(self) -> dict[str, int | float | str]:
        """Train-config entries the method's clients read (a loss weight), besides the round's."""
        return {}

    def sent(self, global_state: State, server_round: int) -> dict[str, State]:
        """The records a train message carries: the global x under ARRAYS (or a lookahead
        from it), and any record of the method's own (a control variate); called once per
        round, before its messages go out."""
        return {ARRAYS: global_state}

    def reply_scalars(self, context: RoundContext) -> dict[str, tuple[float, float]]:
        """Reply metrics the step reads, each with its (floor, cap), both inclusive: a reply
        outside them is dropped (a step count the step divides by)."""
        return {}

    def fold(self, context: RoundContext) -> ReplyFold | None:
        """The step's own intake of each checked reply, when it is not linear in the records
        (normalised or extrapolated steps); None: the round sums the records."""
        return None

    def step_from_mean(self, context: RoundContext, mean: State) -> ServerStep:
        """The new global from the replies' weighted (or robust) mean, in the global's dtypes:
        FedAvg takes the mean as it is."""
        return ServerStep(mean)

    def step_from_sums(self, context: RoundContext, sums: RoundSums) -> ServerStep:
        """The new global from the round's sums (or the folded replies); for methods whose
        `from_mean` is False."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What a resumed run needs of the method (moments, controls): {} for FedAvg."""
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what `state` returned."""

    def describe(self) -> str:
        """One line for the run's log: the method's name and its settings."""
        return self.name
