"""What a method module declares, without Flower: its keys, records, server step and state.

Each method of this package is one module holding its `Method` subclass (or, for one paper's
family of rules, subclasses) next to its paper's equations. The generic round
(`fedfields.flower.strategy`) reads what the subclass declares and never names it:

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
- `state` and `restore`: what a resumed run needs of it (moments, controls);
- `client_hooks`: what its clients add to the one local training loop (`ClientHook`: a term
  of the loss, a correction after backward, the records it adds to the reply and the state
  its node keeps), built from the train message; a node runs the hooks of the method its
  message names ("strategy", looked up in `Method.registered`) and never asks who sent it.

The record and metric names every method shares are defined here, so a method module needs
no Flower import (`fedfields.flower.protocol` re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
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


@dataclass(frozen=True)
class HookResult:
    """What a client hook leaves after a round: records it adds to the reply, and state the
    node keeps for the next round (by name; CPU float32)."""

    records: dict[str, State] = field(default_factory=dict)
    kept: dict[str, State] = field(default_factory=dict)


Kept = Callable[[str], State | None]
"""A node's kept state by name (None: nothing kept yet)."""


class ClientHook:
    """What a method adds to a client's one local training loop, the way nerfacc passes
    `rgb_sigma_fn` to its renderer: a term of the loss, a correction of the gradients after
    backward, and what it leaves (`finish`).

    Built on the CPU from the train message (`Method.client_hooks`), then bound to the
    parameters the loop trains (`bind`, on their device). `loss` and `after_backward` run at
    every step in place and without host reads, so a captured static step runs them too; a
    workspace kept across calls takes the next call's hook into its bound one (`refill`).
    """

    def key(self) -> tuple[Any, ...]:
        """What a captured step bakes in (its Python floats): equal keys share a graph."""
        return (type(self).__name__,)

    def bind(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """Take the parameters the loop trains; the hook's tensors move to their device."""

    def loss(self) -> torch.Tensor | None:
        """A term added to each step's loss, differentiable in the parameters (None: none)."""
        return None

    def after_backward(self) -> None:
        """Correct the parameters' gradients in place, before the optimiser's step."""

    def refill(self, other: ClientHook) -> None:
        """Take `other` (another call's hook, same key, unbound) into this bound hook, in
        place: a captured step reads these tensors."""

    def finish(self, steps: int) -> HookResult:
        """The reply records and kept state after `steps` steps of the loop."""
        return HookResult()


class Method:
    """A federated method's server half and its clients' hooks: FedAvg by default.

    Subclasses set `name` (and `settings_class` when they have run-config keys, whose fields
    are the constructor's keyword arguments) and override what differs from FedAvg. Defining
    a subclass with a `name` registers it (`Method.registered`), so a node finds the hooks
    of the method its train message names.
    """

    registered: ClassVar[dict[str, type[Method]]] = {}
    """Every method class defined so far, by `name`: what a node looks its message's up in."""
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls):
            Method.registered[cls.name] = cls

    @classmethod
    def client_hooks(
        cls, config: Mapping[str, Any], received: Mapping[str, State], kept: Kept
    ) -> list[ClientHook]:
        """The hooks a client runs for this method's train message: `config` is its CONFIG,
        `received` its records (ARRAYS: the global as received), `kept` the node's state."""
        return []

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
