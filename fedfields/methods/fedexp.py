"""FedExP (Jhunjhunwala et al. 2023, Algorithm 1): FedAvg with an adaptive server step that
extrapolates when the clients' updates agree little, from quantities FedAvg already has.

    Delta_i = x - y_i,  Delta = sum_i p_i Delta_i,
    eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps))),  x <- x - eta_g Delta.

The paper weighs clients equally (p_i = 1/M); we use FedAvg's p_i = n_i / sum_j n_j, which is
the same when the clients hold equally many examples. FedMeNF's Table 7: eps = 0.001.

eta_g is capped at max(1, M/2) for M clients: M/2 is its value when the M updates are
orthogonal with equal norms (Jhunjhunwala et al., Sec. 3), and any larger step needs updates
that cancel each other, which two colluding clients can fake (opposite updates, each within
the update-norm cap, drive ||Delta|| to 0 and eta_g to 1e8 without the cap).

The step needs each client's ||Delta_i||: neither SecAgg+ nor client-level DP applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from fedfields.methods.base import (
    ARRAYS,
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
    squared_norm,
)
from fedfields.methods.settings import POSITIVE, StrategySettings, setting

FEDEXP_EPSILON = 1e-3
SERVER_STEP = "fedexp-server-step"
"""Train metric: the round's eta_g (1 is FedAvg's step)."""


def max_server_step(count: int) -> float:
    """The cap on eta_g for `count` clients: max(1, M/2), its value for orthogonal updates."""
    return max(1.0, count / 2)


class FedExPSums:
    """sum_i n_i Delta_i, sum_i n_i ||Delta_i||^2 and sum_i n_i, one client at a time."""

    def __init__(self, global_state: State, epsilon: float = FEDEXP_EPSILON) -> None:
        self.global_state = global_state
        self.epsilon = check_scalar(epsilon, "epsilon")
        self.deltas = RunningSum()
        self.squared_norms = 0.0

    def add(self, local_state: State, weight: float, *, checked: bool = False) -> None:
        """Fold in client i's y_i with its example count n_i > 0."""
        weight = check_scalar(weight, f"client {self.deltas.count}: weight")
        delta = difference(self.global_state, local_state)
        self.deltas.add(delta, weight, checked=checked)
        self.squared_norms += weight * squared_norm(delta)

    @property
    def count(self) -> int:
        """Clients folded in."""
        return self.deltas.count

    def server_step(self) -> float:
        """eta_g = max(1, mean_i ||Delta_i||^2 / (2 (||Delta||^2 + eps))), at most
        `max_server_step(M)`."""
        mean = self.deltas.accumulated()
        norm = squared_norm(mean) / self.deltas.total_weight**2
        step = self.squared_norms / self.deltas.total_weight / (2 * (norm + self.epsilon))
        return min(max(1.0, step), max_server_step(self.count))

    def update(self) -> dict[str, Tensor]:
        """x - eta_g Delta in the global state's dtypes."""
        step = self.server_step() / self.deltas.total_weight
        total = self.deltas.accumulated()
        return {
            key: like(x.detach().double() - step * total[key], x)
            for key, x in self.global_state.items()
        }


@dataclass(frozen=True)
class FedExPSettings(StrategySettings):
    """FedExP's run-config key."""

    epsilon: float = setting(
        FEDEXP_EPSILON, "fedexp-epsilon", "FedExP's epsilon in its server step size", POSITIVE
    )


class FedExP(Method):
    """FedExP's server step: each checked reply folded into `FedExPSums`; eta_g reported as
    "fedexp-server-step".

    Args:
        epsilon: eps of the step size (FedMeNF's Table 7: 0.001).
    """

    name = "fedexp"
    settings_class = FedExPSettings
    secure_aggregation = False
    differential_privacy = False
    from_mean = False

    def __init__(self, *, epsilon: float = FEDEXP_EPSILON) -> None:
        self.epsilon = check_scalar(epsilon, "epsilon")
        self.sums: FedExPSums | None = None

    def fold(self, context: RoundContext) -> ReplyFold:
        """Fold each reply's y_i with its n_i into the round's `FedExPSums`."""
        sums = self.sums = FedExPSums(context.global_state, self.epsilon)

        def add(records: Mapping[str, State], weight: float, scalars: Mapping[str, float]) -> None:
            sums.add(records[ARRAYS], weight, checked=True)

        return add

    def step_from_sums(self, context: RoundContext, sums: RoundSums) -> ServerStep:
        """x - eta_g Delta, with eta_g among the metrics."""
        assert self.sums is not None, "fold opens the round's sums"
        step = {SERVER_STEP: self.sums.server_step()}
        return ServerStep(self.sums.update(), step)
