"""DecentNeRF learned federation (Eqs. 1-2 and Algorithm 1 of the DecentNeRF paper).

Round m, client k: receive G = sum_j dL_j/dg at the aggregate g^(m-1) (securely summed),
update its own weight alpha_k <- alpha_k - eta dL/dalpha_k, train, and upload the payload
alpha_k g_k^(m) together with alpha_k under the reserved key `ALPHA_KEY`. The server sees
only the sum of payloads and returns g^(m) = sum alpha_k g_k / A, A = sum alpha_k; dividing
by the summed alpha (our addition) keeps the aggregate's scale whatever alphas do.

dL/dalpha_k is exact for the aggregation used: through Eq. 1's plain sum g = sum alpha_k g_k
it is <G, g_k> (Eq. 2); through the normalised one, dg/dalpha_k = (g_k - g) / A, so it is
<G, g_k - g> / A. L = sum_j L_j over the users whose G_j are summed.
"""

from __future__ import annotations

from torch import Tensor

from fedfields.methods.base import State, check_scalar, check_states, like

ALPHA_KEY = "__alpha__"
"""Payload entry holding alpha_k as a 1-element tensor (shape (1,)) of the state's dtype."""


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
