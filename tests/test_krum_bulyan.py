"""Krum, Multi-Krum and Bulyan (issue 42, point 8): equal to Flower 1.41's strategies on the
same replies, robust to scaled updates where the mean is not, reachable from run-config."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import strategy as flower_strategy
from test_reply_faults import max_distance, node

from fedfields.flower import FedAvg, FedMeNF, MethodStrategy
from fedfields.flower.protocol import (
    ARRAYS,
    NUM_EXAMPLES,
    NUM_REPLIES,
    TRAIN_LOSS,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.methods.robust import (
    RobustRule,
    bulyan,
    krum_selection,
    robust_aggregate,
    squared_distances,
)
from simulations.in_process_grid import InProcessGrid
from strategies import parse_app_config

State = dict[str, torch.Tensor]


def client_states(count: int, poisoned: int, seed: int) -> list[State]:
    """`count` float32 states near a common point, the last `poisoned` of them scaled far off."""
    gen = torch.Generator().manual_seed(seed)
    centre = {"w": torch.randn(6, 4, generator=gen), "b": torch.randn(6, generator=gen)}
    states = [
        {
            key: value + 0.1 * torch.randn(value.shape, generator=gen)
            for key, value in centre.items()
        }
        for _ in range(count)
    ]
    for state in states[count - poisoned :]:
        for key in state:
            state[key] = state[key] * 50.0 + 10.0
    return states


def same_replies(states: list[State], weights: list[float]) -> tuple[InProcessGrid, ArrayRecord]:
    """A grid of nodes sending `states` with example counts `weights`, and the arrays sent."""
    nodes = [
        node({ARRAYS: state}, {NUM_EXAMPLES: weight, TRAIN_LOSS: float(k)})
        for k, (state, weight) in enumerate(zip(states, weights, strict=True))
    ]
    sent = state_to_arrays({key: torch.zeros_like(value) for key, value in states[0].items()})
    return InProcessGrid(nodes), sent


CASES = [
    ("krum", 7, 1, 0, lambda f, m: flower_strategy.Krum(num_malicious_nodes=f)),
    ("krum", 11, 3, 0, lambda f, m: flower_strategy.Krum(num_malicious_nodes=f)),
    (
        "multi-krum",
        7,
        1,
        3,
        lambda f, m: flower_strategy.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m),
    ),  # noqa: E501
    (
        "multi-krum",
        11,
        2,
        6,
        lambda f, m: flower_strategy.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m),
    ),  # noqa: E501
    ("bulyan", 7, 1, 0, lambda f, m: flower_strategy.Bulyan(num_malicious_nodes=f)),
    ("bulyan", 11, 2, 0, lambda f, m: flower_strategy.Bulyan(num_malicious_nodes=f)),
]


@pytest.mark.parametrize(
    ("rule", "count", "malicious", "select", "flowers"),
    CASES,
    ids=[f"{c[0]}-n{c[1]}-f{c[2]}" for c in CASES],
)
def test_the_rule_equals_flowers_strategy_on_the_same_replies(
    rule: str, count: int, malicious: int, select: int, flowers: object
) -> None:
    states = client_states(count, malicious, seed=count + malicious)
    weights = [10.0 + 7 * k for k in range(count)]
    grid, sent = same_replies(states, weights)
    ours = FedAvg(
        min_available_nodes=count, aggregation_rule=rule, num_malicious=malicious,
        krum_select=select, max_update_norm=0,
    )  # fmt: skip
    messages = ours.configure_train(1, sent, ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages))
    arrays, metrics = ours.aggregate_train(1, replies)
    oracle, _ = flowers(malicious, select).aggregate_train(1, replies)  # type: ignore[operator]
    assert arrays is not None and oracle is not None and metrics is not None
    assert metrics[NUM_REPLIES] == count
    for key in oracle:
        got, expected = arrays[key].numpy(), oracle[key].numpy()
        assert got.dtype == expected.dtype
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(expected))
    honest = [s for s in states[: count - malicious]]
    honest_mean = {k: torch.stack([s[k] for s in honest]).mean(0) for k in honest[0]}
    assert max_distance(arrays_to_state(arrays), honest_mean) < 0.5  # the scaled ones left out


def test_the_mean_follows_the_scaled_updates_the_rules_leave_out() -> None:
    states = client_states(7, 1, seed=3)
    honest_mean = {k: torch.stack([s[k] for s in states[:6]]).mean(0) for k in states[0]}
    mean = {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}
    assert max_distance(mean, honest_mean) > 1.0
    for name in ("krum", "multi-krum", "bulyan"):
        robust = robust_aggregate(RobustRule(name, num_malicious=1), states)
        assert max_distance(robust, honest_mean) < 0.5, name


def test_krum_scores_by_hand() -> None:
    """Four points on a line at 0, 1, 2, 10; f = 0: each scores its 2 nearest others.
    Scores 1+4, 1+1, 1+4, 64+81: the point at 1 wins, then 0 and 2 (stable order)."""
    states = [{"x": torch.tensor([value])} for value in (0.0, 1.0, 2.0, 10.0)]
    assert squared_distances(states)[0].tolist() == [0.0, 1.0, 4.0, 100.0]
    assert krum_selection(states, 0, 3) == [1, 0, 2]
    single = robust_aggregate(RobustRule("krum"), states)
    assert single["x"].tolist() == [1.0]
    weighted = robust_aggregate(
        RobustRule("multi-krum", krum_select=2), states, [1.0, 3.0, 1.0, 1.0]
    )  # noqa: E501
    assert weighted["x"].tolist() == [pytest.approx(0.75)]  # (1 * 0 + 3 * 1) / 4


def test_bulyan_needs_4f_plus_3_states_and_the_strategy_skips_the_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    states = client_states(6, 1, seed=1)
    with pytest.raises(ValueError, match=r"needs at least 4f \+ 3 = 7 states, got 6"):
        bulyan(states, 1)
    grid, sent = same_replies(states, [1.0] * 6)
    strategy = FedAvg(min_available_nodes=6, aggregation_rule="bulyan", num_malicious=1)
    messages = strategy.configure_train(1, sent, ConfigRecord(), grid)
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is None and isinstance(metrics, MetricRecord)
    assert any("needs 7 checked replies, got 6" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("options", "count", "message"),
    [
        ({"aggregation_rule": "krum", "num_malicious": 1}, 4, "needs 5 checked replies, got 4"),
        ({"aggregation_rule": "multi-krum", "num_malicious": 1}, 4, "needs 5 checked replies"),
        (
            {"aggregation_rule": "multi-krum", "num_malicious": 1, "krum_select": 5},
            5,
            "krum-select = 5 and num-malicious = 1 needs 6 checked replies, got 5",
        ),
    ],
)
def test_krum_and_multi_krum_skip_a_round_too_small_for_their_guarantee(
    options: dict, count: int, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Krum with n <= 2f + 2 replies, or Multi-Krum asked for more than n - f of them (which
    would average in the f it assumes malicious), forms no aggregate and says why, where they
    used to run on (Multi-Krum quietly becoming the plain mean, attacker included)."""
    states = client_states(count, 1, seed=2)
    grid, sent = same_replies(states, [1.0] * count)
    strategy = FedAvg(min_available_nodes=count, **options)
    messages = strategy.configure_train(1, sent, ConfigRecord(), grid)
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is None
    assert any(message in r.getMessage() for r in caplog.records)
    enough = FedAvg(min_available_nodes=count + 1, **options)
    grid, sent = same_replies(client_states(count + 1, 1, seed=2), [1.0] * (count + 1))
    messages = enough.configure_train(1, sent, ConfigRecord(), grid)
    assert enough.aggregate_train(1, grid.send_and_receive(messages))[0] is not None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"name": "mean"}, "robust rule must be one of"),
        ({"name": "krum", "num_malicious": -1}, "num_malicious must be an integer >= 0"),
        ({"name": "multi-krum", "krum_select": 1.5}, "krum_select must be an integer >= 0"),
        ({"name": "trimmed-mean", "trim_fraction": 0.5}, r"trim_fraction must be in \[0, 0.5\)"),
    ],
)
def test_bad_rule_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RobustRule(**settings)


def test_run_config_reaches_the_rules_and_bulyan_checks_the_node_count() -> None:
    from strategies import make_strategy

    run_config = {"strategy": "fedprox", "aggregation-rule": "multi-krum", "num-malicious": 2,
                  "krum-select": 4}  # fmt: skip
    config = parse_app_config(run_config)
    assert "num-malicious" not in config.unread_keys()
    strategy = make_strategy(config)
    assert isinstance(strategy, MethodStrategy)
    assert strategy.robust_rule == RobustRule("multi-krum", 0.2, 2, 4)
    meta = FedMeNF.from_config(
        {"aggregation-rule": "bulyan", "num-malicious": 1}, clients_per_round=7, num_clients=7
    )
    assert meta.robust_rule.name == "bulyan" and meta.robust_rule.num_malicious == 1
    with pytest.raises(ValueError, match="'num-malicious' = 1 is read only with aggregation"):
        parse_app_config({"strategy": "fedavg", "num-malicious": 1})
    bulyan_run = parse_app_config(
        {"strategy": "fedavg", "aggregation-rule": "bulyan", "num-malicious": 1}
    )
    bulyan_run.check_node_count(16)  # 8 of 16 a round >= 7
    with pytest.raises(ValueError, match=r"'bulyan' with 'num-malicious' = 1 needs 4f \+ 3 = 7"):
        bulyan_run.check_node_count(12)  # 6 a round
