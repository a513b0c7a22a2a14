"""Aggregation maths checked against references computed another way (numpy, closed forms)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from paper_reference import (
    fedexp_update,
    fednova_update,
    scaffold_client_control_update,
    scaffold_server_update,
    state_sum,
    weighted_mean,
)
from torch import Tensor

from fedfields.methods import (
    ALPHA_KEY,
    DECENTNERF_COST,
    DECENTNERF_PAPER_COST,
    FEDAVG_COST,
    SCAFFOLD_COST,
    RoundCost,
    RunningSum,
    alpha_update,
    alpha_weighted_payload,
    centralised_cost,
    decentnerf_aggregate,
    proximal_term,
    scaffold_corrected_gradient,
    secagg_reconstruction_flops,
)
from fedfields.methods.fedacg import fedacg_lookahead, fedacg_update

F64 = torch.float64


def random_states(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Client states shaped like a small module's state_dict, with an int64 step counter."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "layer.weight": torch.randn(4, 3, generator=gen),
            "layer.bias": torch.randn(4, generator=gen),
            "steps": torch.randint(0, 100, (), generator=gen, dtype=torch.int64),
        }
        for _ in range(count)
    ]


# ------------------------------------------------------------------ FedAvg


def test_weighted_mean_matches_numpy_average() -> None:
    states = random_states(3)
    weights = [10.0, 30.0, 60.0]
    mean = weighted_mean(states, weights)
    assert list(mean) == list(states[0])
    for key in ("layer.weight", "layer.bias"):
        expected = np.average(
            np.stack([s[key].numpy().astype(np.float64) for s in states]), axis=0, weights=weights
        )
        assert mean[key].dtype == torch.float32
        np.testing.assert_allclose(mean[key].numpy(), expected, rtol=1e-6, atol=1e-7)
    # integer buffers are averaged, then rounded to the nearest integer
    counters = [int(s["steps"]) for s in states]
    assert mean["steps"].dtype == torch.int64
    assert int(mean["steps"]) == round(float(np.average(counters, weights=weights)))


def test_weighted_mean_rounds_integer_buffers() -> None:
    states = [{"steps": torch.tensor(v)} for v in (3, 4, 8)]
    # (3*10 + 4*30 + 8*60) / 100 = 6.3 -> 6; (3 + 4 + 2*8) / 4 = 5.75 -> 6; 15 / 3 -> 5
    assert int(weighted_mean(states, [10, 30, 60])["steps"]) == 6
    assert int(weighted_mean(states, [1, 1, 2])["steps"]) == 6
    assert int(weighted_mean(states, [1, 1, 1])["steps"]) == 5


def test_weighted_mean_is_float64_inside() -> None:
    big = torch.tensor([1.0e8], dtype=torch.float32)
    states = [{"w": big}, {"w": torch.ones(1)}, {"w": -big}]
    # float32 accumulation would lose the 1.0 against 1e8
    assert float(weighted_mean(states, [1, 1, 1])["w"]) == pytest.approx(1.0 / 3.0, rel=1e-6)


@pytest.mark.parametrize(
    ("mutate", "weights", "message"),
    [
        (lambda s: s[2].pop("layer.bias"), [1, 1, 1], r"client 2: keys differ.*'layer.bias'"),
        (
            lambda s: s[1].__setitem__("layer.weight", torch.zeros(3, 4)),
            [1, 1, 1],
            r"client 1, key 'layer.weight': shape \(3, 4\)",
        ),
        (
            lambda s: s[2]["layer.bias"].__setitem__(0, float("nan")),
            [1, 1, 1],
            r"client 2, key 'layer.bias': non-finite",
        ),
        (lambda s: None, [1, 0, 1], r"client 1: weight must be positive"),
        (lambda s: None, [1, 1, -2], r"client 2: weight must be positive"),
        (lambda s: None, [1, float("inf"), 1], r"client 1: weight must be positive and finite"),
        (lambda s: None, [1, 1], r"2 weights for 3 client states"),
    ],
)
def test_weighted_mean_errors_name_client_and_key(mutate, weights, message) -> None:
    states = random_states(3)
    mutate(states)
    with pytest.raises(ValueError, match=message):
        weighted_mean(states, weights)


def test_weighted_mean_rejects_empty_input() -> None:
    with pytest.raises(ValueError, match="no states"):
        weighted_mean([], [])


def test_state_sum_matches_numpy() -> None:
    states = random_states(4, seed=3)
    total = state_sum(states)
    expected = np.sum([s["layer.weight"].numpy().astype(np.float64) for s in states], axis=0)
    np.testing.assert_allclose(total["layer.weight"].numpy(), expected, rtol=1e-6)
    assert int(total["steps"]) == sum(int(s["steps"]) for s in states)


# ------------------------------------------------------------------ FedProx


def test_proximal_term_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    local = {"a": torch.randn(5, 2, generator=gen), "b": torch.randn(7, generator=gen)}
    remote = {"a": torch.randn(5, 2, generator=gen), "b": torch.randn(7, generator=gen)}
    params = {k: v.clone().requires_grad_(True) for k, v in local.items()}
    remote_leaf = {k: v.clone().requires_grad_(True) for k, v in remote.items()}
    mu = 0.1
    term = proximal_term(params, remote_leaf, mu)
    squared = sum(
        float(np.sum((local[k].numpy().astype(np.float64) - remote[k].numpy()) ** 2)) for k in local
    )
    expected = 0.5 * mu * squared
    assert term.shape == () and term.dtype == torch.float32
    assert float(term.detach()) == pytest.approx(expected, rel=1e-6)
    term.backward()
    for key in local:
        torch.testing.assert_close(params[key].grad, mu * (local[key] - remote[key]))
        assert remote_leaf[key].grad is None  # the global model is detached


def test_proximal_term_on_module_parameters_and_mu_zero() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    reference = [p.detach().clone() + 1.0 for p in module.parameters()]
    term = proximal_term(module.parameters(), reference, mu=2.0)
    assert float(term.detach()) == pytest.approx(sum(p.numel() for p in reference))  # mu/2 = 1
    zero = proximal_term(module.parameters(), reference, mu=0.0)
    zero.backward()
    assert float(zero.detach()) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in module.parameters())


@pytest.mark.parametrize(
    ("local", "remote", "mu", "message"),
    [
        ({"a": torch.ones(2)}, {"b": torch.ones(2)}, 0.1, "keys differ"),
        ({"a": torch.ones(2)}, {"a": torch.ones(3)}, 0.1, r"parameter 'a': local shape \(2,\)"),
        ([torch.ones(2)], [torch.ones(2), torch.ones(2)], 0.1, "1 local parameters but 2"),
        ([torch.ones(2)], [torch.ones(2)], -1.0, "mu must be non-negative"),
        ([], [], 0.1, "no parameters"),
    ],
)
def test_proximal_term_errors(local, remote, mu, message) -> None:
    with pytest.raises(ValueError, match=message):
        proximal_term(local, remote, mu)


# ------------------------------------------------------------------ Scaffold


def test_scaffold_pieces_match_formulas() -> None:
    gen = torch.Generator().manual_seed(2)

    def draw() -> dict[str, torch.Tensor]:
        return {"w": torch.randn(3, generator=gen, dtype=F64)}

    grad, c, c_i, x, y = draw(), draw(), draw(), draw(), draw()
    corrected = scaffold_corrected_gradient(grad, c, c_i)
    torch.testing.assert_close(corrected["w"], grad["w"] - c_i["w"] + c["w"])
    torch.testing.assert_close(
        scaffold_corrected_gradient(grad["w"], c["w"], c_i["w"]), corrected["w"]
    )

    new_c_i, delta_c = scaffold_client_control_update(
        c_i, c, x, y, local_steps=4, learning_rate=0.5
    )
    expected = c_i["w"] - c["w"] + (x["w"] - y["w"]) / (4 * 0.5)
    torch.testing.assert_close(new_c_i["w"], expected)
    torch.testing.assert_close(delta_c["w"], expected - c_i["w"])

    deltas_y, deltas_c = [draw(), draw()], [draw(), draw()]
    new_x, new_c = scaffold_server_update(
        x, deltas_y, deltas_c, c, num_clients_total=8, global_lr=2
    )
    torch.testing.assert_close(new_x["w"], x["w"] + 2 * (deltas_y[0]["w"] + deltas_y[1]["w"]) / 2)
    torch.testing.assert_close(
        new_c["w"], c["w"] + (2 / 8) * (deltas_c[0]["w"] + deltas_c[1]["w"]) / 2
    )


def test_scaffold_errors() -> None:
    x = {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match="client_control: keys"):
        scaffold_corrected_gradient(x, x, {"v": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"local_state, key 'w': shape \(2,\)"):
        scaffold_client_control_update(x, x, x, {"w": torch.zeros(2)}, 1, 0.1)
    with pytest.raises(ValueError, match="local_steps must be a positive integer"):
        scaffold_client_control_update(x, x, x, x, 0, 0.1)
    with pytest.raises(ValueError, match="client 1, key 'w': non-finite"):
        scaffold_server_update(x, [x, {"w": torch.full((3,), math.inf)}], [x, x], x, 2)
    with pytest.raises(ValueError, match="num_clients_total must be an integer >= the 2"):
        scaffold_server_update(x, [x, x], [x, x], x, 1)


def test_scaffold_removes_fedavg_client_drift_on_least_squares() -> None:
    """Four clients with different quadratics 0.5||A_i w - b_i||^2 and 2..20 local GD steps.

    FedAvg settles at a fixed point away from the minimiser of the average objective;
    Scaffold (option II) converges to that minimiser.
    """
    gen = torch.Generator().manual_seed(1)
    dim, local_steps = 5, [2, 5, 10, 20]
    problems = []
    for i, scale in enumerate([0.5, 1.0, 2.0, 3.0]):
        a = scale * torch.randn(20, dim, generator=gen, dtype=F64)
        problems.append((a, torch.randn(20, generator=gen, dtype=F64) + 3.0 * i))
    hessian = sum(a.T @ a for a, _ in problems)
    w_star = torch.linalg.solve(hessian, sum(a.T @ b for a, b in problems))
    lr = 0.5 / max(float(torch.linalg.eigvalsh(a.T @ a).max()) for a, _ in problems)

    def grad(w: torch.Tensor, i: int) -> torch.Tensor:
        a, b = problems[i]
        return a.T @ (a @ w - b)

    def fedavg_round(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        local = []
        for i, steps in enumerate(local_steps):
            y = x["w"]
            for _ in range(steps):
                y = y - lr * grad(y, i)
            local.append({"w": y})
        return weighted_mean(local, [1.0] * len(problems))

    x_avg = {"w": torch.zeros(dim, dtype=F64)}
    for _ in range(100):
        x_avg = fedavg_round(x_avg)

    x = {"w": torch.zeros(dim, dtype=F64)}
    c = {"w": torch.zeros(dim, dtype=F64)}
    client_controls = [{"w": torch.zeros(dim, dtype=F64)} for _ in problems]
    for _ in range(100):
        deltas_y, deltas_c = [], []
        for i, steps in enumerate(local_steps):
            y = dict(x)
            for _ in range(steps):
                corrected = scaffold_corrected_gradient(
                    {"w": grad(y["w"], i)}, c, client_controls[i]
                )
                y = {"w": y["w"] - lr * corrected["w"]}
            client_controls[i], delta_c = scaffold_client_control_update(
                client_controls[i], c, x, y, steps, lr
            )
            deltas_y.append({"w": y["w"] - x["w"]})
            deltas_c.append(delta_c)
        x, c = scaffold_server_update(x, deltas_y, deltas_c, c, num_clients_total=len(problems))

    fedavg_gap = float((x_avg["w"] - w_star).norm())
    assert float((fedavg_round(x_avg)["w"] - x_avg["w"]).norm()) < 1e-9  # a fixed point ...
    assert fedavg_gap > 0.1 * float(w_star.norm())  # ... that is biased
    assert float((x["w"] - w_star).norm()) < 1e-8
    assert float(c["w"].norm()) < 1e-6  # c = mean_i grad f_i(w*) = 0 at the optimum


# ------------------------------------------------------------------ DecentNeRF


def test_alpha_update_matches_manual_dot_product() -> None:
    states = random_states(2, seed=4)
    gradient = {k: v.float() for k, v in states[0].items() if k != "steps"}
    local = {k: v for k, v in states[1].items() if k != "steps"}
    dot = sum(
        float(np.dot(gradient[k].numpy().astype(np.float64).ravel(), local[k].numpy().ravel()))
        for k in gradient
    )
    assert alpha_update(0.7, gradient, local, learning_rate=0.01) == pytest.approx(
        0.7 - 0.01 * dot, rel=1e-12
    )
    with pytest.raises(ValueError, match=r"previous_local_state: keys differ.*'layer.bias'"):
        alpha_update(0.7, gradient, {"layer.weight": local["layer.weight"]}, 0.01)


def test_decentnerf_aggregate_of_summed_payloads_is_alpha_weighted_mean() -> None:
    states = [{k: v for k, v in s.items() if k != "steps"} for s in random_states(3, seed=5)]
    alphas = [0.5, 1.5, 3.0]
    payloads = [alpha_weighted_payload(s, a) for s, a in zip(states, alphas, strict=True)]
    assert payloads[1][ALPHA_KEY].shape == (1,) and float(payloads[1][ALPHA_KEY]) == 1.5
    torch.testing.assert_close(payloads[1]["layer.bias"], 1.5 * states[1]["layer.bias"])
    aggregate = decentnerf_aggregate(state_sum(payloads))
    assert ALPHA_KEY not in aggregate and list(aggregate) == list(states[0])
    for key in aggregate:
        expected = np.average(
            np.stack([s[key].numpy().astype(np.float64) for s in states]), axis=0, weights=alphas
        )
        np.testing.assert_allclose(aggregate[key].numpy(), expected, rtol=1e-6, atol=1e-7)


def test_decentnerf_guards() -> None:
    state = {"w": torch.ones(3)}
    negative = state_sum([alpha_weighted_payload(state, 0.5), alpha_weighted_payload(state, -1.0)])
    with pytest.raises(ValueError, match="sum of client alphas is -0.5"):
        decentnerf_aggregate(negative)
    with pytest.raises(ValueError, match="lacks the summed alpha"):
        decentnerf_aggregate(state)
    with pytest.raises(ValueError, match="reserved key"):
        alpha_weighted_payload({ALPHA_KEY: torch.ones(1)}, 1.0)
    with pytest.raises(ValueError, match="'steps': torch.int64 is not a float dtype"):
        alpha_weighted_payload({"steps": torch.tensor(3)}, 1.0)


def run_learned_federation(
    data: list[tuple[torch.Tensor, torch.Tensor]], rounds: int, eta: float
) -> tuple[list[float], torch.Tensor]:
    """Algorithm 1 on least squares L_k(w) = 0.5||X_k w - y_k||^2, 20 local GD steps per round.

    Returns the final alphas and aggregate; the server only ever sums (state_sum).
    """
    dim = data[0][0].shape[1]
    alphas = [1.0 / len(data)] * len(data)
    aggregate = {"w": torch.zeros(dim, dtype=F64)}
    local: list[dict[str, torch.Tensor]] = []
    for m in range(1, rounds + 1):
        if m > 1:  # lines 8-12: G = sum_k dL_k/dg at g^(m-1); alpha_k -= eta <G, g_k^(m-1)>
            gradients = [{"w": x.T @ (x @ aggregate["w"] - y)} for x, y in data]
            total = state_sum(gradients)
            alphas = [alpha_update(a, total, g, eta) for a, g in zip(alphas, local, strict=True)]
        local = []
        for x, y in data:  # line 14: local training from g^(m-1)
            w, lr = aggregate["w"], 0.5 / float(torch.linalg.eigvalsh(x.T @ x).max())
            for _ in range(20):
                w = w - lr * x.T @ (x @ w - y)
            local.append({"w": w})
        payloads = [alpha_weighted_payload(g, a) for g, a in zip(local, alphas, strict=True)]
        aggregate = decentnerf_aggregate(state_sum(payloads))  # lines 15-18
    return alphas, aggregate["w"]


def make_clients(corrupt_size: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Four clean clients (200 samples of y = X w*) and one with `corrupt_size` shuffled labels."""
    gen = torch.Generator().manual_seed(0)
    w_true = torch.randn(4, generator=gen, dtype=F64)
    data = []
    for _ in range(4):
        x = torch.randn(200, 4, generator=gen, dtype=F64)
        data.append((x, x @ w_true + 0.05 * torch.randn(200, generator=gen, dtype=F64)))
    x = torch.randn(corrupt_size, 4, generator=gen, dtype=F64)
    data.append((x, (x @ w_true)[torch.randperm(corrupt_size, generator=gen)]))
    return data, w_true


def test_learned_alpha_down_weights_a_small_corrupted_client() -> None:
    """dL/dalpha_k = <G, g_k> (Eq. 2): a client whose model moves the aggregate uphill on the
    summed loss loses weight. The corrupted client (8 shuffled labels) pulls the equal-weight
    aggregate far from w* while adding little to the summed loss, so its alpha falls."""
    data, w_true = make_clients(corrupt_size=8)
    alphas, aggregate = run_learned_federation(data, rounds=5, eta=1e-4)
    _, equal_weights = run_learned_federation(data, rounds=5, eta=0.0)
    assert alphas[4] < 0.5 * min(alphas[:4])
    assert float((aggregate - w_true).norm()) < 0.5 * float((equal_weights - w_true).norm())


def test_learned_alpha_follows_the_summed_loss_not_data_quality() -> None:
    """With as many shuffled samples as clean ones (equal curvature), the equal-weight aggregate
    already minimises the summed loss, so Eq. 2 gives no signal and alphas stay level."""
    data, _ = make_clients(corrupt_size=200)
    alphas, _ = run_learned_federation(data, rounds=5, eta=1e-4)
    assert max(alphas) - min(alphas) < 0.05 * min(alphas)


# ------------------------------------------------------------------ accounting


def test_round_cost_formulas() -> None:
    d, n = 1000, 7
    assert FEDAVG_COST.round_cost(d, n) == RoundCost(d * n, n * (d + 1) * 4, n * d * 4)
    assert SCAFFOLD_COST.round_cost(d, n, bytes_per_value=2) == RoundCost(
        2 * d * n, n * 2 * d * 2, n * 2 * d * 2
    )
    ours = DECENTNERF_COST.round_cost(d, n)
    assert ours == RoundCost((2 * d + 1) * n, n * (2 * d + 1) * 4, n * 2 * d * 4)
    assert ours.server_flops > FEDAVG_COST.round_cost(d, n).server_flops
    assert DECENTNERF_PAPER_COST.round_cost(d, n).server_flops == 4 * d * n


def test_accounting_reproduces_decentnerf_appendix_b2() -> None:
    d, n, rounds = 10**6, 20, 30  # ~1M-parameter global MLP, 20 users, 30 rounds
    assert rounds * FEDAVG_COST.round_cost(d, n).server_flops == 0.6e9  # FedNeRF
    # DecentNeRF: weights 0.6e9 + gradients 0.6e9 + dot products 1.2e9
    assert rounds * DECENTNERF_PAPER_COST.round_cost(d, n).server_flops == 2.4e9
    assert rounds * secagg_reconstruction_flops(d, n) == 3e9  # SecAgg+ reconstruction
    # NeRF-W: 12,500 batches of 4096 rays (80 images of 800x800) x 350 MFLOPs x 30 epochs
    centralised = centralised_cost(80 * 800 * 800, epochs=30)
    assert centralised == 12_500 * 350 * 10**6 * 30
    assert 125e12 < centralised < 135e12  # "around 130e12 FLOPs"


def test_round_cost_errors() -> None:
    assert FEDAVG_COST.round_cost(10, 0) == RoundCost(0, 0, 0)
    with pytest.raises(ValueError, match="num_clients must be an integer >= 0"):
        FEDAVG_COST.round_cost(10, -1)
    with pytest.raises(ValueError, match="bytes_per_value must be an integer >= 1"):
        FEDAVG_COST.round_cost(10, 2, bytes_per_value=0)


def test_running_sum_equals_the_list_rules_one_state_at_a_time() -> None:
    gen = torch.Generator().manual_seed(3)
    states = [
        {
            "w": torch.randn(5, 4, generator=gen),
            "steps": torch.tensor(10 * k + 1, dtype=torch.int64),
        }
        for k in range(7)
    ]
    weights = [1.0, 2.5, 0.25, 7.0, 3.0, 1.5, 4.0]
    total, plain = RunningSum(), RunningSum()
    for state, weight in zip(states, weights, strict=True):
        total.add(state, weight)
        plain.add(state)
    for key, value in weighted_mean(states, weights).items():
        assert total.mean()[key].dtype == value.dtype
        torch.testing.assert_close(total.mean()[key], value)
    for key, value in state_sum(states).items():
        torch.testing.assert_close(plain.sum()[key], value)
    assert total.total_weight == pytest.approx(sum(weights)) and total.count == 7


def test_running_sum_names_the_state_and_key_that_do_not_fit() -> None:
    total = RunningSum()
    total.add({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="state 1, key 'a': shape"):
        total.add({"a": torch.zeros(4), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"state 1: keys differ .*missing \['b'\]"):
        total.add({"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="state 1, key 'b': non-finite values"):
        total.add({"a": torch.ones(3), "b": torch.tensor([0.0, float("inf")])})
    assert total.count == 1 and float(total.sum()["a"].abs().max()) == 0.0  # nothing half-added
    with pytest.raises(ValueError, match="no states given"):
        RunningSum().sum()


# ------------------------------------------------------------------ FedNova, FedExP, FedACG


def test_fednova_by_hand_and_fedavg_when_steps_are_equal() -> None:
    x = {"w": torch.zeros(1)}
    ys = [{"w": torch.tensor([2.0])}, {"w": torch.tensor([4.0])}]
    # tau = 1 and 4, equal n: d = 0.5 (-2)/1 + 0.5 (-4)/4 = -1.5, tau_eff = 2.5 -> x = 3.75
    assert float(fednova_update(x, ys, [1.0, 1.0], [1, 4])["w"]) == pytest.approx(3.75)
    gen = torch.Generator().manual_seed(1)
    x = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    ys = [{k: v + torch.randn(v.shape, generator=gen) for k, v in x.items()} for _ in range(4)]
    weights = [1.0, 3.0, 2.0, 5.0]
    for key, value in weighted_mean(ys, weights).items():
        torch.testing.assert_close(fednova_update(x, ys, weights, [7] * 4)[key], value)


def test_fednova_removes_the_objective_inconsistency_of_unequal_local_steps() -> None:
    """Quadratic clients F_i = 1/2 (y - c_i)^2 with gradient steps of size eta: client i's
    tau_i steps move y by (1 - (1 - eta)^tau_i) (c_i - x). FedAvg's fixed point leans to the
    client that runs longer; FedNova's is the minimiser of sum_i p_i F_i (FedNova Sec. 3)."""
    centres, steps, eta = [0.0, 1.0], [1, 10], 0.01

    def local(x: float, centre: float, tau: int) -> dict[str, Tensor]:
        return {"w": torch.tensor([x + (1 - (1 - eta) ** tau) * (centre - x)], dtype=F64)}

    fedavg_x, fednova_x = 0.3, 0.3
    for _ in range(3000):
        ys = [local(fedavg_x, c, t) for c, t in zip(centres, steps, strict=True)]
        fedavg_x = float(weighted_mean(ys, [1.0, 1.0])["w"])
        ys = [local(fednova_x, c, t) for c, t in zip(centres, steps, strict=True)]
        x = {"w": torch.tensor([fednova_x], dtype=F64)}
        fednova_x = float(fednova_update(x, ys, [1.0, 1.0], steps)["w"])
    # fixed points: sum_i w_i (c_i - x) = 0 with FedAvg's w_i = 1 - (1 - eta)^tau_i and
    # FedNova's w_i = (1 - (1 - eta)^tau_i) / tau_i
    moved = [1 - (1 - eta) ** tau for tau in steps]
    fedavg_fixed = moved[1] / sum(moved)
    normalised = [m / tau for m, tau in zip(moved, steps, strict=True)]
    fednova_fixed = normalised[1] / sum(normalised)
    assert fedavg_x == pytest.approx(fedavg_fixed, abs=1e-4) and fedavg_x > 0.9
    assert fednova_x == pytest.approx(fednova_fixed, abs=1e-4)
    assert abs(fednova_x - 0.5) < 0.02  # near the minimiser of F_1 + F_2, 0.5


def test_fedexp_matches_its_formula_and_never_steps_less_than_fedavg() -> None:
    gen = torch.Generator().manual_seed(2)
    x = {"w": torch.randn(5, generator=gen, dtype=F64)}
    ys = [{"w": x["w"] + torch.randn(5, generator=gen, dtype=F64)} for _ in range(4)]
    weights = np.array([1.0, 2.0, 1.0, 4.0])
    deltas = np.stack([(x["w"] - y["w"]).numpy() for y in ys])
    p = weights / weights.sum()
    mean = p @ deltas
    eta = max(1.0, (p @ (deltas**2).sum(1)) / (2 * (mean @ mean + 1e-3)))
    new, step = fedexp_update(x, ys, list(weights), epsilon=1e-3)
    assert step == pytest.approx(eta) and step > 1.0  # disagreeing clients: extrapolate
    np.testing.assert_allclose(new["w"].numpy(), x["w"].numpy() - eta * mean)
    agreeing = [{"w": x["w"] + 1.0} for _ in range(3)]
    assert fedexp_update(x, agreeing, [1.0, 1.0, 1.0])[1] == 1.0  # FedAvg's step


def test_fedacg_two_rounds_by_hand() -> None:
    x, m = {"w": torch.tensor([1.0], dtype=F64)}, {"w": torch.zeros(1, dtype=F64)}
    assert float(fedacg_lookahead(x, m, 0.2)["w"]) == 1.0
    x, m = fedacg_update(x, m, {"w": torch.tensor([2.0], dtype=F64)}, 0.2)
    assert (float(x["w"]), float(m["w"])) == pytest.approx((2.0, 1.0))
    assert float(fedacg_lookahead(x, m, 0.2)["w"]) == pytest.approx(2.2)
    x, m = fedacg_update(x, m, {"w": torch.tensor([3.0], dtype=F64)}, 0.2)
    # Delta = 3 - 2.2 = 0.8; m = 0.2 + 0.8 = 1.0; x = 2 + 1 = 3 (the clients' mean)
    assert (float(x["w"]), float(m["w"])) == pytest.approx((3.0, 1.0))


def test_running_sum_does_not_depend_on_the_order_states_arrive_in() -> None:
    gen = torch.Generator().manual_seed(8)
    states = [{"w": torch.randn(2000, generator=gen)} for _ in range(8)]
    weights = [3.0, 5.0, 6.0, 7.0, 9.0, 10.0, 11.0, 13.0]  # example counts
    results = []
    for order in (range(8), [7, 2, 5, 0, 3, 6, 1, 4]):
        total = RunningSum()
        for index in order:
            total.add(states[index], weights[index])
        results.append(total.mean()["w"])
    assert torch.equal(results[0], results[1])  # bit for bit: seeded runs repeat
