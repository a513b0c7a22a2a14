"""FedNova (Wang et al. 2020, Eq. 6-7): normalised averaging of clients that ran different
numbers of local steps, so a client that ran longer does not pull the model further.

    x <- x - tau_eff * sum_i p_i (x - y_i) / tau_i,    tau_eff = sum_i p_i tau_i,

with p_i = n_i / sum_j n_j. With plain local SGD a_i = tau_i (the paper's ||a_i||_1); our
clients run Adam, where FedNova's momentum correction does not apply, so a_i = tau_i too.
Equal tau_i give FedAvg. Replies carry "train-steps" (tau_i); one outside [1, "local-steps"
sent] is dropped (tau_i scales the step, so an inflated count would move the global
arbitrarily far). The server needs each client's tau_i and y_i: neither SecAgg+ nor
client-level DP (whose clipped sum does not bound a step divided by tau_i) applies.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from fedfields.methods.base import (
    ARRAYS,
    LOCAL_STEPS,
    TRAIN_STEPS,
    Method,
    ReplyFold,
    RoundContext,
    RoundSums,
    RunningSum,
    ServerStep,
    State,
    check_scalar,
    difference,
    like,
)


class FedNovaSums:
    """What FedNova needs, folded in one client at a time: sum_i n_i (x - y_i) / tau_i,
    sum_i n_i tau_i and sum_i n_i (memory: one float64 model)."""

    def __init__(self, global_state: State) -> None:
        self.global_state = global_state
        self.normalised = RunningSum()
        self.weight_sum = 0.0
        self.weighted_steps = 0.0

    def add(
        self, local_state: State, weight: float, steps: float, *, checked: bool = False
    ) -> None:
        """Fold in client i's y_i with its example count n_i > 0 and local steps tau_i > 0."""
        label = f"client {self.normalised.count}"
        weight = check_scalar(weight, f"{label}: weight")
        steps = check_scalar(steps, f"{label}: local steps")
        delta = difference(self.global_state, local_state)
        self.normalised.add(delta, weight / steps, checked=checked)
        self.weight_sum += weight
        self.weighted_steps += weight * steps

    @property
    def count(self) -> int:
        """Clients folded in."""
        return self.normalised.count

    def update(self) -> dict[str, Tensor]:
        """x - tau_eff sum_i p_i (x - y_i) / tau_i in the global state's dtypes."""
        direction = self.normalised.accumulated()  # ValueError if no client was added
        tau_eff = self.weighted_steps / self.weight_sum
        return {
            key: like(x.detach().double() - tau_eff * direction[key] / self.weight_sum, x)
            for key, x in self.global_state.items()
        }


class FedNova(Method):
    """FedNova's server step: each checked reply folded into `FedNovaSums` with its tau_i."""

    name = "fednova"
    secure_aggregation = False
    differential_privacy = False
    from_mean = False

    def __init__(self) -> None:
        self.sums: FedNovaSums | None = None

    def reply_scalars(self, context: RoundContext) -> dict[str, tuple[float, float]]:
        """tau_i in [1, the "local-steps" sent]."""
        return {TRAIN_STEPS: (1.0, float(int(context.sent_config[LOCAL_STEPS])))}

    def fold(self, context: RoundContext) -> ReplyFold:
        """Fold each reply's y_i with its n_i and tau_i into the round's `FedNovaSums`."""
        sums = self.sums = FedNovaSums(context.global_state)

        def add(records: Mapping[str, State], weight: float, scalars: Mapping[str, float]) -> None:
            sums.add(records[ARRAYS], weight, scalars[TRAIN_STEPS], checked=True)

        return add

    def step_from_sums(self, context: RoundContext, sums: RoundSums) -> ServerStep:
        """x - tau_eff sum_i p_i (x - y_i) / tau_i."""
        assert self.sums is not None, "fold opens the round's sums"
        return ServerStep(self.sums.update())
