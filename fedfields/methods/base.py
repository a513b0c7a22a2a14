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
- `gradient_query`: a query phase before the train messages (the record its replies carry and
  how it is bounded), whose sum goes out with them;
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
no Flower import (`fedfields.flower.protocol` re-exports them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

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
SERVER_ROUND = "server-round"
"""Train-config entry: the round a message belongs to."""
GRADIENT = "gradient"
"""Record of a gradient query's reply, G_k = dL_k/dg at the global received, and of its sum
G = sum_k G_k, which the train messages then carry (`Method.gradient_query`)."""

State = Mapping[str, Tensor]
"""A model's or a record's tensors by name, ordered like a module's `state_dict()`."""


@dataclass(frozen=True)
class ScaleSpec:
    """A record sent scaled by the client's own weight s: its entry `key` holds s (shape (1,)),
    the others s x. The round sums it as it is (under DP the update s x - s g), divides s out
    before the update-norm check, and drops a plaintext reply whose s lies outside
    [`low`, `high`] under `check`, for the reason `drop_reason` gives in a user's words."""

    key: str
    low: float
    high: float
    check: str
    drop_reason: str


@dataclass(frozen=True)
class RecordSpec:
    """One record of a method's replies and how the round treats it.

    `delta`: summed as the reply's record minus the record sent under the same name (ARRAYS:
    y_k - g), in plaintext and under SecAgg+ alike. `norm_check` and `norm_cap`: a plaintext
    reply whose record has an L2 norm above `norm_cap` is dropped and counted under that
    check (None: no cap), for the reason `drop_reason` gives in a user's words.
    `compressed`: under compressed uploads the record travels compressed (ARRAYS as the
    update from what was sent, any other on its own). `scale`: the record is sent scaled by
    the client's own weight (`ScaleSpec`; ARRAYS only)."""

    name: str
    delta: bool = False
    norm_check: str = ""
    norm_cap: float | None = None
    drop_reason: str = ""
    compressed: bool = True
    scale: ScaleSpec | None = None


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
    resolution: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Per record and key, a secure sum's error bound (a sum within it may be 0); {} plain."""
    noise_std: float | None = None
    """Under DP, the std of the noise on each summed entry (z C); None without DP."""


@dataclass(frozen=True)
class ServerStep:
    """A server step's result: the new global (None: none formed, the global stays) and the
    method's own train metrics for the round. Without a new global, `failure` says why the
    sums could form none (counted as a failed sum) or `warning` why the step declined to."""

    new_global: State | None
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str = ""
    warning: str = ""


ReplyFold = Callable[[Mapping[str, Mapping[str, Tensor]], float, Mapping[str, float]], None]
"""A non-linear server step's intake of one checked reply: its records, its weight and the
scalars the method asked for (`Method.reply_scalars`)."""


@dataclass(frozen=True)
class HookResult:
    """What a client hook (or a method's `client_reply`) leaves after a round: records it adds
    to the reply, and state the node keeps for the next round (by name; tensors CPU float32,
    `kept_values` JSON-able)."""

    records: dict[str, State] = field(default_factory=dict)
    kept: dict[str, State] = field(default_factory=dict)
    kept_values: dict[str, dict[str, Any]] = field(default_factory=dict)


Kept = Callable[[str], State | None]
"""A node's kept state by name (None: nothing kept yet)."""


class NodeKept(Protocol):
    """A node's kept state, as `fedfields.flower.NodeState` reads it: tensors and JSON-able
    values by name (None: nothing kept yet)."""

    def tensors(self, name: str) -> dict[str, Tensor] | None: ...

    def values(self, name: str) -> dict[str, Any] | None: ...


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
    personal_field: ClassVar[bool] = False
    """Whether its clients train a personal field beside the shared one, which never leaves the
    node (NeRF-W's transient branch): what a user's own content goes to."""
    counts_examples: ClassVar[bool] = True
    """Whether its train replies report "num-examples" (the mean's weight, a reported count);
    False for a method that weighs each reply by the client's own scale."""

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

    @classmethod
    def client_reply(
        cls, config: Mapping[str, Any], received: Mapping[str, State], kept: NodeKept,
        local_state: State,
    ) -> HookResult:  # fmt: skip
        """What a client's train reply carries under ARRAYS after training, and what its node
        keeps: the local state as it is; a method may send a transform of it (a payload scaled
        by the client's own weight). `config`, `received` and `kept` as for `client_hooks`."""
        return HookResult({ARRAYS: dict(local_state)})

    def client_config(self) -> dict[str, int | float | str]:
        """Train-config entries the method's clients read (a loss weight), besides the round's."""
        return {}

    def gradient_query(self) -> RecordSpec | None:
        """The gradient query each round from 2 on runs before its train messages (None:
        none): the round's sampled nodes reply G_k = dL_k/dg at the global they receive under
        GRADIENT, bounded as the spec says; G = sum_k G_k goes out with the train messages
        under GRADIENT, with `query_config`'s entries."""
        return None

    def query_config(self) -> dict[str, int | float | str]:
        """Train-config entries sent with a gradient query's sum G (what it was taken at)."""
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


# State-dict checks and arithmetic shared by the aggregation rules.
#
# A state is `dict[str, Tensor]` ordered like a module's `state_dict()`. The rules compute in
# float64 and hand back each key's input dtype; non-floating tensors (step counters, masks)
# are rounded to the nearest integer (half to even) on the way back.


def check_states(states: Sequence[State], names: Sequence[str] | None = None) -> None:
    """Raise one ValueError naming the state and key unless all share keys and shapes.

    Floating tensors must be finite. `names` label the states (default "client 0", ...).
    """
    if len(states) == 0:
        raise ValueError("no states given")
    labels = list(names) if names is not None else [f"client {i}" for i in range(len(states))]
    reference = states[0]
    if len(reference) == 0:
        raise ValueError(f"{labels[0]}: state has no tensors")
    for label, state in zip(labels, states, strict=True):
        missing = [key for key in reference if key not in state]
        extra = [key for key in state if key not in reference]
        if missing or extra:
            raise ValueError(
                f"{label}: keys differ from {labels[0]}'s (missing {missing}, unexpected {extra})"
            )
        for key, tensor in state.items():
            if tensor.shape != reference[key].shape:
                raise ValueError(
                    f"{label}, key {key!r}: shape {tuple(tensor.shape)} differs from "
                    f"{labels[0]}'s {tuple(reference[key].shape)}"
                )
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{label}, key {key!r}: non-finite values")


def check_scalar(value: float, name: str, *, positive: bool = True) -> float:
    """Return `value` as a float, raising ValueError unless finite (and > 0 if `positive`)."""
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        requirement = "positive and finite" if positive else "finite"
        raise ValueError(f"{name} must be {requirement}, got {value}")
    return value


def like(value: Tensor, reference: Tensor) -> Tensor:
    """Cast a float64 result back to `reference`'s dtype, rounding for non-floating dtypes."""
    if not reference.is_floating_point():
        value = torch.round(value)
    return value.to(reference.dtype)


class RunningSum:
    """sum_k w_k x_k and sum_k w_k accumulated one state at a time.

    What a server needs to aggregate replies as they arrive: memory is one float64 copy of
    the model whatever the number of states. Accumulating in float64 (not float32, which is
    faster: docs/BENCHMARKS.md) keeps the result independent of the order replies arrive in,
    so a seeded run repeats exactly; `sum()` / `mean()` hand back each key's input dtype
    (tests/paper_reference.py's list forms are the reference they are checked against).
    """

    def __init__(self) -> None:
        self.total: dict[str, Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # each key's input dtype, handed back
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: State, weight: float = 1.0, *, checked: bool = False) -> None:
        """Add w * state; the first state fixes keys and shapes, a mismatch raises ValueError.

        Non-finite values raise too, unless the caller already `checked` them (a server's
        `reply_state` does, naming the node). `state` is only read, never kept: read-only
        views of a message's bytes are fine.
        """
        label = f"state {self.count}"
        weight = check_scalar(weight, f"{label}: weight", positive=False)
        if self.count == 0:
            if len(state) == 0:
                raise ValueError(f"{label}: state has no tensors")
            self.dtypes = {key: value.dtype for key, value in state.items()}
            self.total = {
                key: torch.empty(value.shape, dtype=torch.float64) for key, value in state.items()
            }
        else:
            self._check_like_first(state)
        for key, value in state.items():  # all checks before any addition: never half a state
            if not checked and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"{label}, key {key!r}: non-finite values")
        for key, value in state.items():
            if self.count == 0:  # copy exactly into float64, then scale in float64
                self.total[key].copy_(value.detach()).mul_(weight)
            else:
                self.total[key].add_(value.detach(), alpha=weight)
        self.total_weight += weight
        self.count += 1

    def _check_like_first(self, state: State) -> None:
        """One ValueError naming the state and key unless keys and shapes match the first's."""
        label = f"state {self.count}"
        missing = [key for key in self.total if key not in state]
        extra = [key for key in state if key not in self.total]
        if missing or extra:
            raise ValueError(
                f"{label}: keys differ from state 0's (missing {missing}, unexpected {extra})"
            )
        for key, value in state.items():
            if value.shape != self.total[key].shape:
                raise ValueError(
                    f"{label}, key {key!r}: shape {tuple(value.shape)} differs from state 0's "
                    f"{tuple(self.total[key].shape)}"
                )

    def accumulated(self) -> dict[str, Tensor]:
        """sum_k w_k x_k in float64, for rules that compute further on it."""
        if self.count == 0:
            raise ValueError("no states given")
        return dict(self.total)

    def sum(self) -> dict[str, Tensor]:
        """sum_k w_k x_k in each key's input dtype; ValueError if nothing was added."""
        return {
            key: _handed_back(value, self.dtypes[key]) for key, value in self.accumulated().items()
        }

    def mean(self) -> dict[str, Tensor]:
        """sum_k w_k x_k / sum_k w_k in each key's input dtype (FedAvg's weighted mean)."""
        total = self.accumulated()
        if self.total_weight <= 0:
            raise ValueError(f"weights sum to {self.total_weight}, not a positive number")
        return {
            key: _handed_back(value / self.total_weight, self.dtypes[key])
            for key, value in total.items()
        }


def _handed_back(value: Tensor, dtype: torch.dtype) -> Tensor:
    """An accumulated value in the input `dtype`, rounded to nearest for integer dtypes."""
    if not dtype.is_floating_point:
        value = torch.round(value)
    return value.to(dtype)


def difference(minuend: State, subtrahend: State) -> dict[str, Tensor]:
    """minuend - subtrahend key-wise in float64 (keys of `minuend`)."""
    return {key: value.double() - subtrahend[key].double() for key, value in minuend.items()}


def squared_norm(state: State) -> float:
    """sum of squares over every tensor of `state`, in float64."""
    return sum(float(value.double().square().sum()) for value in state.values())


def to_wire(tensor: Tensor) -> Tensor:
    """A detached CPU copy, float32 if floating: the form every tensor a client uploads takes."""
    dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to("cpu", dtype, copy=True)


def check_state(state: Mapping[str, Tensor], parameters: Mapping[str, Tensor], what: str) -> None:
    """Raise a ValueError naming missing or unexpected keys, or a key with the wrong shape."""
    missing = [name for name in parameters if name not in state]
    unexpected = [name for name in state if name not in parameters]
    if missing or unexpected:
        raise ValueError(f"{what}: missing keys {missing}, unexpected keys {unexpected}")
    for name, parameter in parameters.items():
        if state[name].shape != parameter.shape:
            raise ValueError(
                f"{what}, key {name!r}: shape {tuple(state[name].shape)} differs from the "
                f"field's {tuple(parameter.shape)}"
            )


def on_device(
    state: Mapping[str, Tensor] | None, parameters: Mapping[str, Tensor], what: str
) -> dict[str, Tensor]:
    """`state` checked against the parameters and moved to their device and dtype.

    None stands for the parameters' current values.
    """
    if state is None:
        return {name: p.detach().clone() for name, p in parameters.items()}
    check_state(state, parameters, what)
    return {name: state[name].to(p.device, p.dtype) for name, p in parameters.items()}


def update_norm(state: State, reference: State | None = None, scale: float = 1.0) -> float:
    """||state / scale - reference|| in float64 over `reference`'s keys (||state|| over all of
    its keys without a reference): how far a reply moved from the model it was sent; `scale`
    divides out a payload's scale (a weight the client multiplied its state by)."""
    keys = state.keys() if reference is None else reference.keys()
    total = 0.0
    for key in keys:
        value = state[key].detach().double()
        if scale != 1.0:
            value = value / scale
        if reference is not None:
            value = value - reference[key].detach().double()
        total += float(value.square().sum())
    return math.sqrt(total)
