"""DecentNeRF learned federation (Eqs. 1-2 and Algorithm 1 of the DecentNeRF paper).

Round m, client k: receive G = sum_j dL_j/dg at the aggregate g^(m-1) (securely summed),
update its own weight alpha_k <- alpha_k - eta dL/dalpha_k, train, and upload the payload
alpha_k g_k^(m) together with alpha_k under the reserved key `ALPHA_KEY`. The server sees
only the sum of payloads and returns g^(m) = sum alpha_k g_k / A, A = sum alpha_k; dividing
by the summed alpha (our addition) keeps the aggregate's scale whatever alphas do.

dL/dalpha_k is exact for the aggregation used: through Eq. 1's plain sum g = sum alpha_k g_k
it is <G, g_k> (Eq. 2); through the normalised one, dg/dalpha_k = (g_k - g) / A, so it is
<G, g_k - g> / A. L = sum_j L_j over the users whose G_j are summed.

As a `Method` (`DecentNeRF`): round m >= 2 opens with a gradient query whose sum G goes out
with the train messages, with the summed alpha A^(m-1) that normalised g^(m-1) ("alpha-sum")
and its round ("aggregate-round"); replies are summed unweighted as the payload scaled by
alpha_k (`ScaleSpec`: alpha_k in [alpha-max * 1e-6, alpha-max], g_k = payload / alpha_k under
the update-norm bound; ||G_k|| at most max-gradient-norm), and the step divides the summed
payload by the summed alpha. Under DP a payload is summed as (alpha_k (g_k - g), alpha_k),
clipped jointly, G_k on its own; both sums are noised (docs/PRIVACY.md). Its clients train a
personal field beside the global one (NeRF-W's transient branch, kept on the node) and reply
with `DecentNeRF.client_reply`: alpha_k updated (`client_alpha`), then the scaled payload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from fedfields.methods.accounting import DECENTNERF_COST
from fedfields.methods.base import (
    ARRAYS,
    GRADIENT,
    SERVER_ROUND,
    HookResult,
    Method,
    NodeKept,
    RecordSpec,
    RoundContext,
    RoundSums,
    ScaleSpec,
    ServerStep,
    State,
    check_scalar,
    check_states,
    like,
)
from fedfields.methods.settings import NON_NEGATIVE, StrategySettings, optional_cap, setting, within

ALPHA_KEY = "__alpha__"
"""Payload entry holding alpha_k as a 1-element tensor (shape (1,)) of the state's dtype."""
ALPHA_LR = "alpha-lr"
"""Train-config entry: eta of the alpha step."""
ALPHA_MAX = "alpha-max"
"""Train-config entry: the largest alpha_k the server takes; clients clamp theirs into
[alpha-max * ALPHA_FLOOR, alpha-max]."""
ALPHA_SUM = "alpha-sum"
"""Train-config entry with G: A^(m-1), the summed alpha that normalised the aggregate sent."""
AGGREGATE_ROUND = "aggregate-round"
"""Train-config entry with G: the round whose replies formed that aggregate (m - 1)."""
ALPHA_STATE = "decentnerf-alpha"
"""Node-state values: the user's alpha_k, its history [[round, alpha], ...] and the round of
its last upload ("uploaded")."""
PREVIOUS_GLOBAL = "decentnerf-previous-global"
"""Node-state tensors: the user's last local global field g_k^(m-1), for Eq. 2."""
INITIAL_ALPHA: dict[str, Any] = {"alpha": 1.0, "history": [], "uploaded": 0}
"""A user's alpha state before its first round: alpha_k = 1."""

DEFAULT_ALPHA_MAX = 100.0
"""Largest alpha_k a plaintext reply may carry: alphas start at 1, so 100 lets one user weigh
a hundred times an untouched one before its reply is dropped."""
ALPHA_FLOOR = 1e-6
"""A client's alpha_k never falls below alpha-max * ALPHA_FLOOR: a positive weight that
leaves its user in the sum with a negligible share, where alpha_k <= 0 would break it."""
DP_ALPHA_MARGIN = 3.0
"""Under DP the noised sum of alpha_k divides the payload's: a sum within this many noise stds
(z C) of 0 forms no aggregate rather than amplifying the noise."""
DEFAULT_MAX_GRADIENT_NORM = 1e4
"""Largest ||G_k|| a plaintext gradient reply may have: far above an honest user's, which grows
as beta-min falls (the colour loss is weighted by up to 1/(2 beta_min^2)) and shrinks as the
field trains (docs/MODES.md gives the norms measured); one oversized G_k would move every
user's alpha."""


@dataclass(frozen=True)
class DecentNeRFSettings(StrategySettings):
    """DecentNeRF's run-config keys."""

    alpha_lr: float = setting(
        1.0,
        "alpha-lr",
        "DecentNeRF eta of the learned federation (0: FedAvg weights)",
        NON_NEGATIVE,
    )
    alpha_max: float = setting(
        DEFAULT_ALPHA_MAX,
        "alpha-max",
        "DecentNeRF: a reply with alpha_k outside [alpha-max * 1e-6, alpha-max] is dropped; "
        "in [1, 1e6] (alphas start at 1; a larger one overflows the float32 payload)",
        within(1.0, 1e6),
    )
    max_gradient_norm: float = setting(
        DEFAULT_MAX_GRADIENT_NORM,
        "max-gradient-norm",
        "DecentNeRF: a gradient reply with ||G_k|| above it is dropped (0: no cap)",
        NON_NEGATIVE,
    )


class DecentNeRF(Method):
    """DecentNeRF: g^(m) = sum_k alpha_k g_k / sum_k alpha_k from summed payloads only.

    The server never reads one client's alpha_k and ignores "num-examples"; a failed or
    missing reply is left out of a sum, and dividing by the remaining clients' summed alpha
    keeps the aggregate's scale. If no gradient reply arrives, no G is sent and clients keep
    their alpha.

    Args:
        alpha_lr: eta in alpha_k <- alpha_k - eta dL/dalpha_k, sent as "alpha-lr". The paper
            gives no value; dL/dalpha scales with the model and the users' losses, so tune
            eta per setting (docs/BENCHMARKS.md gives the values measured).
        alpha_max: a plaintext reply whose alpha_k is outside [alpha_max * 1e-6, alpha_max]
            is dropped.
        max_gradient_norm: a plaintext gradient reply with ||G_k|| above it is dropped (0 or
            None: no cap); raise it with beta-min far below NeRF-W's 0.03.
    """

    name = "decentnerf"
    settings_class = DecentNeRFSettings
    cost_model = DECENTNERF_COST
    weight_metric = ""
    from_mean = False
    personal_field = True
    counts_examples = False

    def __init__(
        self,
        *,
        alpha_lr: float = 1.0,
        alpha_max: float = DEFAULT_ALPHA_MAX,
        max_gradient_norm: float | None = DEFAULT_MAX_GRADIENT_NORM,
    ) -> None:
        self.alpha_lr = check_scalar(alpha_lr, "alpha_lr", positive=False)
        if self.alpha_lr < 0:
            raise ValueError(f"alpha_lr must be >= 0 (0 freezes alpha), got {alpha_lr}")
        self.alpha_max = check_scalar(alpha_max, "alpha_max")
        self.max_gradient_norm = optional_cap(max_gradient_norm, "max_gradient_norm")
        self.last_aggregate: tuple[int, float] | None = None
        """(round, summed alpha) of the latest aggregate this method formed."""

    @property
    def alpha_floor(self) -> float:
        """The least alpha_k a reply may carry: the clients' clamp (`clamped_alpha`), less a
        float32 rounding; alpha_k divides the payload, so a subnormal one is refused."""
        return self.alpha_max * ALPHA_FLOOR * (1 - 1e-6)

    def reply_records(self) -> tuple[RecordSpec, ...]:
        """alpha_k g_k plus alpha_k under `ALPHA_KEY`, summed as it is (Algorithm 1, line 15)."""
        scale = ScaleSpec(
            ALPHA_KEY,
            self.alpha_floor,
            self.alpha_max,
            "alpha",
            "DecentNeRF replies carried an alpha_k outside [alpha-max * 1e-6, alpha-max]",
        )
        return (RecordSpec(ARRAYS, scale=scale),)

    def gradient_query(self) -> RecordSpec:
        """G = sum_k dL_k/dg at g^(m-1) over the round's sampled users (Algorithm 1, line 10)."""
        return RecordSpec(
            GRADIENT,
            norm_check="gradient-norm",
            norm_cap=self.max_gradient_norm,
            drop_reason="gradient replies' ||G_k|| exceeded max-gradient-norm",
        )

    @classmethod
    def client_reply(
        cls, config: Mapping[str, Any], received: Mapping[str, State], kept: NodeKept,
        local_state: State,
    ) -> HookResult:  # fmt: skip
        """alpha_k g_k plus alpha_k (Algorithm 1, line 15) after the alpha step (line 12,
        `client_alpha`); the node keeps alpha_k with its history, and g_k^(m) as the next
        round's g_k^(m-1)."""
        alpha = client_alpha(
            config, received, kept.values(ALPHA_STATE) or INITIAL_ALPHA,
            kept.tensors(PREVIOUS_GLOBAL),
        )  # fmt: skip
        payload = alpha_weighted_payload(local_state, alpha["alpha"])
        return HookResult(
            {ARRAYS: payload},
            kept={PREVIOUS_GLOBAL: dict(local_state)},
            kept_values={ALPHA_STATE: alpha},
        )

    def client_config(self) -> dict[str, int | float | str]:
        """eta ("alpha-lr") and the clients' clamp ("alpha-max")."""
        return {ALPHA_LR: self.alpha_lr, ALPHA_MAX: self.alpha_max}

    def query_config(self) -> dict[str, int | float | str]:
        """With G: the round and summed alpha of the aggregate G was taken at, so a client
        takes the normalised aggregation's derivative (and knows a stale g_k)."""
        if self.last_aggregate is None:
            return {}
        return {AGGREGATE_ROUND: self.last_aggregate[0], ALPHA_SUM: self.last_aggregate[1]}

    def step_from_sums(self, context: RoundContext, sums: RoundSums) -> ServerStep:
        """g^(m) = sum_k alpha_k g_k / sum_k alpha_k from the summed payload alone (Algorithm 1,
        line 18); none when the summed alpha is not above the secure sum's resolution, or under
        DP within `DP_ALPHA_MARGIN` noise stds of 0."""
        payload_sum = sums.records[ARRAYS]
        alpha_sum = float(payload_sum[ALPHA_KEY].double().sum())
        resolution = sums.resolution.get(ARRAYS, {}).get(ALPHA_KEY, 0.0)
        if not (math.isfinite(alpha_sum) and alpha_sum > resolution):
            return ServerStep(None, failure="the summed alpha_k is not positive: no aggregate")
        if sums.noise_std is not None and alpha_sum <= DP_ALPHA_MARGIN * sums.noise_std:
            return ServerStep(
                None,
                warning=f"the noised alpha sum lies within {DP_ALPHA_MARGIN:g} noise stds of 0; "
                "dividing by it would blow the noise up, no aggregate",
            )
        aggregate = decentnerf_aggregate(payload_sum)
        self.last_aggregate = (context.server_round, alpha_sum)
        dtypes = {key: value.dtype for key, value in context.global_state.items()}
        return ServerStep({key: value.to(dtypes[key]) for key, value in aggregate.items()})

    def state(self) -> dict[str, Any]:
        """(round, summed alpha) of the latest aggregate."""
        return {"last-aggregate": self.last_aggregate}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back the latest aggregate's bookkeeping."""
        last = state["last-aggregate"]
        self.last_aggregate = None if last is None else (int(last[0]), float(last[1]))

    def describe(self) -> str:
        """The method and its settings."""
        cap = self.max_gradient_norm
        return (
            f"{self.name} (alpha-lr {self.alpha_lr:g}, alpha-max {self.alpha_max:g}, "
            f"max-gradient-norm {'none' if cap is None else f'{cap:g}'})"
        )


def alpha_gradient(
    gradient_sum: State,
    previous_local_state: State,
    aggregate: State | None = None,
    alpha_sum: float | None = None,
) -> float:
    """dL/dalpha_k in float64: <G, g_k^(m-1) - g^(m-1)> / A^(m-1) through the normalised
    aggregation (`aggregate` g^(m-1) and `alpha_sum` A^(m-1) given), else Eq. 2's <G, g_k^(m-1)>.

    `gradient_sum` is G = sum_j dL_j/dg at g^(m-1); all dicts hold the federated keys only.
    """
    if (aggregate is None) != (alpha_sum is None):
        raise ValueError("give both aggregate and alpha_sum (normalised) or neither (Eq. 2)")
    states, names = [gradient_sum, previous_local_state], ["gradient_sum", "previous_local_state"]
    if aggregate is not None:
        states, names = [*states, aggregate], [*names, "aggregate"]
    check_states(states, names=names)
    direction = {key: previous_local_state[key].double() for key in gradient_sum}
    scale = 1.0
    if aggregate is not None and alpha_sum is not None:
        scale = 1.0 / check_scalar(alpha_sum, "alpha_sum")
        direction = {key: value - aggregate[key].double() for key, value in direction.items()}
    inner = sum(float((gradient_sum[key].double() * direction[key]).sum()) for key in gradient_sum)
    return inner * scale


def alpha_update(
    alpha: float,
    gradient_sum: State,
    previous_local_state: State,
    learning_rate: float,
    aggregate: State | None = None,
    alpha_sum: float | None = None,
) -> float:
    """alpha_k - eta * dL/dalpha_k (Algorithm 1, line 12; `alpha_gradient`)."""
    alpha = check_scalar(alpha, "alpha", positive=False)
    learning_rate = check_scalar(learning_rate, "learning_rate", positive=False)
    if learning_rate < 0:
        raise ValueError(f"learning_rate must be >= 0 (0 freezes alpha), got {learning_rate}")
    derivative = alpha_gradient(gradient_sum, previous_local_state, aggregate, alpha_sum)
    return check_scalar(alpha - learning_rate * derivative, "updated alpha", positive=False)


def alpha_weighted_payload(local_state: State, alpha: float) -> dict[str, Tensor]:
    """alpha_k * g_k^(m) key-wise plus alpha_k under `ALPHA_KEY` (Algorithm 1, line 15)."""
    alpha = check_scalar(alpha, "alpha", positive=False)
    check_states([local_state], names=["local_state"])
    if ALPHA_KEY in local_state:
        raise ValueError(f"local_state uses the reserved key {ALPHA_KEY!r}")
    for key, tensor in local_state.items():
        if not tensor.is_floating_point():
            raise ValueError(f"local_state, key {key!r}: {tensor.dtype} is not a float dtype")
    payload = {key: like(g.detach().double() * alpha, g) for key, g in local_state.items()}
    reference = next(iter(local_state.values()))
    payload[ALPHA_KEY] = reference.new_full((1,), alpha)
    return payload


def decentnerf_aggregate(summed_payload: State) -> dict[str, Tensor]:
    """g^(m) = sum_k alpha_k g_k / sum_k alpha_k from the summed payload (Algorithm 1, line 18).

    Reads only sums, so no client's alpha is seen; the summed alpha must be positive.
    """
    if ALPHA_KEY not in summed_payload:
        raise ValueError(f"summed_payload lacks the summed alpha under {ALPHA_KEY!r}")
    check_states([summed_payload], names=["summed_payload"])
    alpha_entry = summed_payload[ALPHA_KEY]
    if alpha_entry.numel() != 1:
        raise ValueError(f"{ALPHA_KEY!r} must hold one value, got shape {tuple(alpha_entry.shape)}")
    alpha_sum = float(alpha_entry.double().reshape(()))
    if not alpha_sum > 0:
        raise ValueError(
            f"sum of client alphas is {alpha_sum}; it must be positive to normalise the "
            "aggregate (lower the alpha learning rate or re-initialise the alphas)"
        )
    return {
        key: like(total.double() / alpha_sum, total)
        for key, total in summed_payload.items()
        if key != ALPHA_KEY
    }


def client_alpha(
    config: Mapping[str, Any],
    received: Mapping[str, State],
    kept: Mapping[str, Any],
    previous: State | None,
) -> dict[str, Any]:
    """A client's alpha state after round "server-round"'s step: alpha_k <- alpha_k - eta
    dL/dalpha_k (`alpha_update`) clamped into [alpha-max * ALPHA_FLOOR, alpha-max] (the
    message's "alpha-max", else DEFAULT_ALPHA_MAX), with the round in its history.

    `kept` is the stored state (`INITIAL_ALPHA` before the first round), `previous` the stored
    g_k^(m-1). The step runs when the message carries G (`received` GRADIENT): with
    "alpha-sum" through the normalised aggregation's <G, g_k - g> / A, else Eq. 2's <G, g_k>.
    A stale g_k (this user's last upload predates the aggregate's round: it was not sampled
    then) took no part in g^(m-1), so dL/dalpha_k = 0 and alpha_k is kept.
    """
    alpha = float(kept["alpha"])
    aggregate_round = config.get(AGGREGATE_ROUND)
    current = aggregate_round is None or int(aggregate_round) == int(kept.get("uploaded", 0))
    if GRADIENT in received and previous is not None and current:
        alpha_lr = float(config.get(ALPHA_LR, DecentNeRFSettings.alpha_lr))
        aggregate, alpha_sum = None, None
        if ALPHA_SUM in config:
            aggregate, alpha_sum = received[ARRAYS], float(config[ALPHA_SUM])
        alpha = alpha_update(alpha, received[GRADIENT], previous, alpha_lr, aggregate, alpha_sum)
    alpha = clamped_alpha(alpha, float(config.get(ALPHA_MAX, DEFAULT_ALPHA_MAX)))
    server_round = int(config[SERVER_ROUND])
    return {"alpha": alpha, "history": [*kept["history"], [server_round, alpha]],
            "uploaded": server_round}  # fmt: skip


def clamped_alpha(alpha: float, alpha_max: float) -> float:
    """`alpha` clamped into [alpha_max * ALPHA_FLOOR, alpha_max], the range a server takes."""
    if not (math.isfinite(alpha_max) and alpha_max > 0):
        raise ValueError(f"train config {ALPHA_MAX!r} must be positive and finite")
    return min(max(alpha, alpha_max * ALPHA_FLOOR), alpha_max)
