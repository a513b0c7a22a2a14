"""DecentNeRF's maths on real fields: NeRF-W's loss by hand, alpha's gradient against finite
differences through both aggregations, and the client's rule for stale local fields."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from test_federated_training import RENDER, composite_mse, make_global, scene  # noqa: F401

from fedfields.data.scene import Scene
from fedfields.flower import DecentNeRFClient, NodeState
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    GRADIENT,
    SERVER_ROUND,
    STRATEGY,
    state_to_arrays,
)
from fedfields.methods import alpha_gradient, alpha_update
from fedfields.methods.decentnerf import AGGREGATE_ROUND, ALPHA_LR, ALPHA_SUM
from fedfields.train import federated_state, load_federated_state, loss_gradient
from fedfields.train.nerfw import nerfw_loss
from simulations.in_process_grid import set_task_identity


def test_nerfw_loss_matches_a_hand_computation() -> None:
    predicted = torch.tensor([[0.2, 0.4, 0.6], [1.0, 0.0, 0.5]])
    target = torch.tensor([[0.3, 0.4, 0.2], [0.5, 0.5, 0.5]])
    uncertainty = torch.tensor([0.07, 0.47])
    densities = torch.tensor([1.0, 3.0, 0.0, 4.0])
    terms = nerfw_loss(predicted, target, uncertainty, densities, beta_min=0.03,
                       transient_density_weight=0.01)  # fmt: skip
    # ray 1: beta 0.1, error 0.01 + 0 + 0.16 = 0.17 -> 0.17 / 0.02 = 8.5, log 0.1
    # ray 2: beta 0.5, error 0.25 + 0.25 + 0 = 0.5 -> 0.5 / 0.5 = 1.0, log 0.5
    colour, log_beta, density = (8.5 + 1.0) / 2, (math.log(0.1) + math.log(0.5)) / 2, 0.01 * 2.0
    assert float(terms.colour) == pytest.approx(colour, rel=1e-5)
    assert float(terms.log_beta) == pytest.approx(log_beta, rel=1e-5)
    assert float(terms.transient_density) == pytest.approx(density, rel=1e-5)
    assert float(terms.total) == pytest.approx(colour + log_beta + density, rel=1e-5)
    assert float(terms.mse) == pytest.approx((0.17 + 0.5) / 6, rel=1e-5)
    empty = nerfw_loss(predicted, target, uncertainty, torch.zeros(0))
    assert float(empty.transient_density) == 0.0
    with pytest.raises(ValueError, match="beta_min must be positive"):
        nerfw_loss(predicted, target, uncertainty, densities, beta_min=0.0)


def _users_and_fields(views: Scene) -> tuple[list[Scene], list[dict[str, torch.Tensor]]]:
    """Three users (views {0, 1}, {2}, {3}) and three different local global fields."""
    users = [views.subset([0, 1]), views.subset([2]), views.subset([3])]
    states = []
    for seed in range(3):
        field = make_global(seed)
        with torch.no_grad():
            for parameter in field.parameters():
                parameter.mul_(1.0 + 0.5 * seed)
        states.append(federated_state(field))
    return users, states


def _aggregate(states, alphas, normalised: bool) -> dict[str, torch.Tensor]:
    total = sum(alphas) if normalised else 1.0
    return {key: sum(a * s[key] for a, s in zip(alphas, states, strict=True)) / total
            for key in states[0]}  # fmt: skip


@pytest.mark.parametrize("normalised", [True, False])
def test_alpha_gradient_matches_finite_differences_on_a_real_field(
    scene: Scene,  # noqa: F811
    normalised: bool,
) -> None:
    """dL/dalpha_k, L = sum_j MSE_j at the aggregate, through sum alpha g / sum alpha (ours)
    and through Eq. 1's plain sum, against central differences of L in alpha_k."""
    users, states = _users_and_fields(scene)
    alphas = [0.6, 1.0, 1.5] if normalised else [0.2, 0.3, 0.4]
    field = make_global()
    pixels = max(len(user) * 25 * 25 for user in users)

    def total_loss(weights: list[float]) -> float:
        load_federated_state(field, _aggregate(states, weights, normalised))
        return sum(composite_mse(field, user) for user in users)

    load_federated_state(field, _aggregate(states, alphas, normalised))
    gradients = [loss_gradient(field, user, RENDER, None, num_rays=pixels) for user in users]
    gradient_sum = {key: sum(g[key] for g in gradients) for key in gradients[0]}
    aggregate = _aggregate(states, alphas, normalised)
    for k in range(3):
        if normalised:
            analytic = alpha_gradient(gradient_sum, states[k], aggregate, sum(alphas))
        else:
            analytic = alpha_gradient(gradient_sum, states[k])
        epsilon = 0.02 * alphas[k]
        up, down = list(alphas), list(alphas)
        up[k] += epsilon
        down[k] -= epsilon
        numeric = (total_loss(up) - total_loss(down)) / (2 * epsilon)
        assert abs(numeric) > 1e-4, "the check needs a non-trivial derivative"
        assert analytic == pytest.approx(numeric, rel=0.05), f"user {k}"
    if normalised:  # Eq. 2's formula is not the derivative through the normalised sum
        plain = alpha_gradient(gradient_sum, states[0])
        assert plain != pytest.approx(alpha_gradient(gradient_sum, states[0], aggregate,
                                                     sum(alphas)), rel=0.5)  # fmt: skip


def _train_message(
    server_round: int, aggregate: dict, gradient: dict | None, config: dict
) -> Message:
    set_task_identity()
    records = {
        ARRAYS: state_to_arrays(aggregate),
        CONFIG: ConfigRecord(
            {SERVER_ROUND: server_round, STRATEGY: "decentnerf", ALPHA_LR: 0.5, **config}
        ),
    }
    if gradient is not None:
        records[GRADIENT] = state_to_arrays(gradient)
    return Message(RecordDict(records), dst_node_id=7, message_type=MessageType.TRAIN)


def test_client_updates_alpha_through_the_normalised_aggregate_and_keeps_it_when_stale() -> None:
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    client = DecentNeRFClient(NodeState(context))
    g_1 = {"w": torch.tensor([1.0, 2.0, 3.0])}
    aggregate = {"w": torch.tensor([0.5, 1.0, 1.0])}
    gradient = {"w": torch.tensor([0.2, -0.1, 0.4])}
    client.train_reply(_train_message(1, aggregate, None, {}), g_1, {})
    assert client.alpha == 1.0

    # Round 2: its round-1 upload made the aggregate; <G, g_1 - g> / A = 0.8 / 4.
    current = {AGGREGATE_ROUND: 1, ALPHA_SUM: 4.0}
    client.train_reply(_train_message(2, aggregate, gradient, current), g_1, {})
    expected = alpha_update(1.0, gradient, g_1, 0.5, aggregate, 4.0)
    assert client.alpha == pytest.approx(expected) and expected == pytest.approx(1.0 - 0.5 * 0.2)

    # Round 4 carries round 3's aggregate; this user last uploaded in round 2: stale, kept.
    stale = {AGGREGATE_ROUND: 3, ALPHA_SUM: 4.0}
    client.train_reply(_train_message(4, aggregate, gradient, stale), g_1, {})
    assert client.alpha == pytest.approx(expected)
    assert [round_ for round_, _ in client.history] == [1, 2, 4]

    # A server that sends no alpha sum gets Eq. 2's <G, g_k> (= 1.2).
    client.train_reply(_train_message(5, aggregate, gradient, {}), g_1, {})
    assert client.alpha == pytest.approx(expected - 0.5 * 1.2)
