"""FedAvgM, FedAdam, FedYogi and FedAdagrad against Flower 1.41's own, Flower's as the oracle.

Both strategies run three rounds over the same in-process federation of least-squares clients
(deterministic gradient descent, float64), so each round's replies are the same; the global
arrays after every round must agree. The maths is also checked without Flower, against a
hand-written FedAvgM; tests/test_secure_aggregation.py runs them under SecAgg+.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import strategy as flower_strategy
from test_strategies import heterogeneous_problems, initial_state, least_squares_app

from fedfields.flower import FedAdagrad, FedAdam, FedAvgM, FedYogi, ProtocolStrategy
from fedfields.flower.protocol import LOCAL_STEPS, STRATEGY, arrays_to_state, state_to_arrays
from fedfields.methods.fedavgm import fedavgm_update
from fedfields.methods.fedopt import AdaptiveStep, adam_moment, adaptive_update
from simulations.in_process_grid import InProcessGrid
from strategies import make_strategy, parse_app_config

SAMPLING = {"fraction_train": 1.0, "fraction_evaluate": 0.0, "min_available_nodes": 3}
PAIRS: dict[str, tuple[Callable[[], object], Callable[[], ProtocolStrategy]]] = {
    "fedavgm": (
        lambda: flower_strategy.FedAvgM(server_learning_rate=0.7, server_momentum=0.9, **SAMPLING),
        lambda: FedAvgM(server_learning_rate=0.7, server_momentum=0.9, **SAMPLING),
    ),
    "fedadam": (
        lambda: flower_strategy.FedAdam(eta=0.05, beta_1=0.8, beta_2=0.95, tau=1e-2, **SAMPLING),
        lambda: FedAdam(server_learning_rate=0.05, beta_1=0.8, beta_2=0.95, tau=1e-2, **SAMPLING),
    ),
    "fedyogi": (
        lambda: flower_strategy.FedYogi(**SAMPLING),
        lambda: FedYogi(**SAMPLING),
    ),
    "fedadagrad": (
        lambda: flower_strategy.FedAdagrad(eta=0.2, **SAMPLING),
        lambda: FedAdagrad(server_learning_rate=0.2, **SAMPLING),
    ),
}
ROUNDS = 3


def globals_per_round(strategy: object, train_config: dict) -> list:
    """The global state after rounds 0..ROUNDS of `strategy` over three least-squares clients."""
    problems = heterogeneous_problems(count=3)
    app = least_squares_app(problems, lr=0.05)
    grid = InProcessGrid([app] * 3, raise_errors=True)
    seen: list[dict[str, torch.Tensor]] = []

    def record(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        seen.append(arrays_to_state(arrays))
        return None

    strategy.start(  # type: ignore[attr-defined]
        grid,
        state_to_arrays(initial_state()),
        num_rounds=ROUNDS,
        train_config=ConfigRecord(train_config),
        evaluate_fn=record,
    )
    return seen


@pytest.mark.parametrize("name", list(PAIRS))
def test_equal_to_flowers_strategy_on_the_same_replies(name: str) -> None:
    flowers, ours = PAIRS[name]
    oracle = globals_per_round(flowers(), {STRATEGY: "fedavg", LOCAL_STEPS: 2})
    mine = globals_per_round(ours(), {LOCAL_STEPS: 2})
    assert len(oracle) == len(mine) == ROUNDS + 1
    moved = max((oracle[-1][key] - oracle[0][key]).abs().max().item() for key in oracle[0])
    assert moved > 1e-3  # the rounds moved the model: the comparison is not vacuous
    for theirs, own in zip(oracle, mine, strict=True):
        assert theirs.keys() == own.keys()
        for key in theirs:
            torch.testing.assert_close(own[key], theirs[key].to(own[key].dtype))


def test_fedavgm_momentum_by_hand() -> None:
    """Two steps of v <- beta v + (x - mean), x <- x - eta v, written out."""
    x = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    means = [torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([0.0, 0.5])]
    momentum, expected_v = None, torch.zeros(2, dtype=torch.float64)
    for mean in means:
        expected_v = 0.9 * expected_v + (x["w"] - mean.double())
        expected_x = x["w"] - 0.5 * expected_v
        x, momentum = fedavgm_update(x, {"w": mean.double()}, momentum, 0.5, 0.9)
        torch.testing.assert_close(x["w"], expected_x)
    assert fedavgm_update(x, {"w": means[0]}, None, 1.0, 0.0) == ({"w": means[0]}, None)


def test_adaptive_step_leaves_non_float_tensors_at_the_mean() -> None:
    rule = AdaptiveStep(0.1, 0.9, 0.99, 1e-3, adam_moment, bias_corrected=True)
    x = {"w": torch.zeros(2), "count": torch.tensor([3])}
    mean = {"w": torch.ones(2), "count": torch.tensor([5])}
    new, (m, v) = adaptive_update(rule, 1, x, mean, None)
    assert new["count"].item() == 5 and new["w"].dtype == torch.float32
    assert m.keys() == v.keys() == {"w"}


def test_the_run_config_builds_them_with_flowers_defaults() -> None:
    """server-learning-rate 0 takes each strategy's (Flower's) default; set, it is used."""
    config = parse_app_config({"strategy": "fedyogi", "beta-1": 0.5, "min-train-nodes": 3})
    yogi = make_strategy(config)
    assert isinstance(yogi, FedYogi) and (
        yogi.method.rule.learning_rate,
        yogi.method.rule.beta_1,
    ) == (1e-2, 0.5)
    avgm = make_strategy(parse_app_config({"strategy": "fedavgm", "server-momentum": 0.9}))
    assert isinstance(avgm, FedAvgM) and (
        avgm.method.server_learning_rate,
        avgm.method.server_momentum,
    ) == (
        1.0,
        0.9,
    )
    adagrad = make_strategy(parse_app_config({"strategy": "fedadagrad",
                                              "server-learning-rate": 0.3}))  # fmt: skip
    assert adagrad.method.rule.learning_rate == 0.3 and adagrad.method.rule.beta_1 == 0.0
    with pytest.raises(ValueError, match="'beta-1' = 0.5 is read only with strategy='fedadam'"):
        parse_app_config({"strategy": "fedadagrad", "beta-1": 0.5})
    with pytest.raises(ValueError, match="run-config 'beta-2' must be in \\[0, 1\\)"):
        parse_app_config({"strategy": "fedadam", "beta-2": 1.0})
    median = parse_app_config({"strategy": "fedadam", "aggregation-rule": "median"})
    assert make_strategy(median).robust_rule is not None
