"""Bad replies are dropped, never fatal; robust aggregation (median, trimmed mean) holds
against a scaled update (issue 18, item 2). Issue 33: dtypes, non-finite metrics, secure-mode
bad sums, DecentNeRF's alpha clamp, split sample replies, and runs that keep forming no
aggregate (`max-empty-rounds`, through the launcher too).

Each bad reply kind is sent by one node next to honest ones; the round must give exactly
what the honest nodes alone give (the bad reply never touches a sum), stay finite and count
the drop. The robust rules are checked against numpy and scipy.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from scipy import stats
from torch import Tensor

from fedfields.flower import (
    DecentNeRF,
    DecentNeRFClient,
    EmptyRoundsError,
    FedACG,
    FedAvg,
    FedExP,
    FedMeNF,
    FedNova,
    FedProx,
    NodeState,
    ProtocolStrategy,
    Scaffold,
)
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import (
    ARRAYS,
    GRADIENT,
    METRICS,
    NUM_DROPPED,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_MISSING,
    NUM_REPLIES,
    SAMPLES,
    TRAIN_LOSS,
    TRAIN_STEPS,
    USER_KEY_ACTION,
    USER_KEY_MESSAGE_TYPE,
    BadReply,
    arrays_to_state,
    checked_samples,
    state_to_arrays,
)
from fedfields.flower.round import SECURE_FAILURES, SECURE_SUMS
from fedfields.flower.secure_aggregation import secure_aggregation_mod
from fedfields.methods import ALPHA_KEY, alpha_weighted_payload
from fedfields.methods.base import update_norm
from fedfields.methods.decentnerf import ALPHA_FLOOR, DEFAULT_ALPHA_MAX
from fedfields.methods.robust import (
    RobustRule,
    coordinate_median,
    coordinate_trimmed_mean,
    robust_aggregate,
)
from fedfields.methods.scaffold import CONTROL_DELTA
from fedfields.privacy.secagg_plan import SecureAggregationConfig
from simulations.in_process_grid import InProcessGrid, set_task_identity
from simulations.job import reply_counts
from simulations.split_job import run_split_job
from strategies import parse_app_config

State = dict[str, Tensor]
F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
HONEST = 3


def global_state() -> State:
    return {
        "weight": torch.tensor([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]], dtype=F64),
        "bias": torch.tensor([0.5, -0.5], dtype=F64),
    }


def honest_state(k: int, scale: float = 0.1) -> State:
    """The global model moved by a small, client-specific step."""
    gen = torch.Generator().manual_seed(k)
    return {key: v + scale * torch.randn(v.shape, generator=gen, dtype=F64)
            for key, v in global_state().items()}  # fmt: skip


def node(records: dict[str, State], metrics: dict[str, float]) -> Callable:
    """A node answering every message with `records` and `metrics`, but the user-key query,
    which it answers as a fedfields client does."""

    def handler(message: Message, context: Context) -> Message:
        if message.metadata.message_type == USER_KEY_MESSAGE_TYPE:
            return answer_user_key(message, context)
        content = RecordDict({name: state_to_arrays(state) for name, state in records.items()})
        content[METRICS] = MetricRecord(metrics)
        return Message(content, reply_to=message)

    return handler


# ------------------------------------------------------------------ strategies and replies

WEIGHTED = ("fedavg", "fedprox", "fedmenf", "fednova", "fedexp", "fedacg")
NOVA_STEPS = 8
"""FedNova's "local-steps": the honest clients report 2-5 "train-steps"."""


def make(name: str, count: int, **options: object) -> ProtocolStrategy:
    """A fresh strategy sampling all `count` nodes."""
    if name == "fedmenf":
        return FedMeNF(clients_per_round=count, num_clients=count, **options)
    kinds: dict[str, Callable[..., ProtocolStrategy]] = {
        "fedavg": FedAvg,
        "fedprox": lambda **o: FedProx(proximal_mu=0.1, **o),
        "fednova": lambda **o: FedNova(local_steps=NOVA_STEPS, **o),
        "fedexp": FedExP,
        "fedacg": FedACG,
        "scaffold": Scaffold,
        "decentnerf": DecentNeRF,
    }
    return kinds[name](min_available_nodes=count, **options)


def honest_reply(name: str, k: int) -> tuple[dict[str, State], dict[str, float]]:
    """What honest client k sends to strategy `name`: records and metrics."""
    state = honest_state(k)
    metrics = {NUM_EXAMPLES: 10.0 + 5 * k, TRAIN_STEPS: 2.0 + k, TRAIN_LOSS: 0.1 * k}
    if name == "decentnerf":
        return {ARRAYS: alpha_weighted_payload(state, 0.5 + k)}, metrics
    if name == "scaffold":
        return {ARRAYS: state, CONTROL_DELTA: honest_state(100 + k, 0.01)}, metrics
    return {ARRAYS: state}, metrics


def run_round(
    name: str, replies: list[tuple[dict[str, State], dict[str, float]]], **options: object
) -> tuple[ArrayRecord | None, MetricRecord, ProtocolStrategy]:
    strategy = make(name, len(replies), **options)
    grid = InProcessGrid([node(records, metrics) for records, metrics in replies])
    sent = state_to_arrays(global_state())
    messages = strategy.configure_train(1, sent, ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert metrics is not None
    return arrays, metrics, strategy


# ------------------------------------------------------------------ bad reply kinds


def _set(record: str, key: str, value: Tensor) -> Callable:
    def corrupt(records: dict[str, State], metrics: dict[str, float]) -> None:
        records[record] = {**records[record], key: value}

    return corrupt


def _nan(records: dict[str, State], metrics: dict[str, float]) -> None:
    weight = records[ARRAYS]["weight"].clone()
    weight[0, 1] = float("nan")
    records[ARRAYS] = {**records[ARRAYS], "weight": weight}


def _inf(records: dict[str, State], metrics: dict[str, float]) -> None:
    bias = records[ARRAYS]["bias"].clone()
    bias[1] = -float("inf")
    records[ARRAYS] = {**records[ARRAYS], "bias": bias}


def _wide(records: dict[str, State], metrics: dict[str, float]) -> None:
    records[ARRAYS] = {**records[ARRAYS], "weight": torch.zeros(2, 4, dtype=F64)}


def _missing_key(records: dict[str, State], metrics: dict[str, float]) -> None:
    records[ARRAYS] = {k: v for k, v in records[ARRAYS].items() if k != "bias"}


def _extra_key(records: dict[str, State], metrics: dict[str, float]) -> None:
    records[ARRAYS] = {**records[ARRAYS], "smuggled": torch.zeros(3, dtype=F64)}


def _no_record(records: dict[str, State], metrics: dict[str, float]) -> None:
    del records[ARRAYS]


def _scaled_update(records: dict[str, State], metrics: dict[str, float]) -> None:
    """g + 1e6 (g_k - g), keeping a DecentNeRF payload's alpha_k."""
    start = global_state()
    payload = records[ARRAYS]
    alpha = float(payload[ALPHA_KEY]) if ALPHA_KEY in payload else 1.0
    scaled = {k: start[k] + 1e6 * (payload[k] / alpha - start[k]) for k in start}
    records[ARRAYS] = alpha_weighted_payload(scaled, alpha) if ALPHA_KEY in payload else scaled


def _metric(key: str, value: float | None) -> Callable:
    def corrupt(records: dict[str, State], metrics: dict[str, float]) -> None:
        if value is None:
            del metrics[key]
        else:
            metrics[key] = value

    return corrupt


def _alpha(alpha: float) -> Callable:
    def corrupt(records: dict[str, State], metrics: dict[str, float]) -> None:
        records[ARRAYS] = alpha_weighted_payload(honest_state(7), alpha)

    return corrupt


def _as_dtype(dtype: torch.dtype) -> Callable:
    """The right keys and shapes in an integer or bool dtype (alpha_k's entry included)."""

    def corrupt(records: dict[str, State], metrics: dict[str, float]) -> None:
        records[ARRAYS] = {key: value.to(dtype) for key, value in records[ARRAYS].items()}

    return corrupt


def _list_metric(records: dict[str, State], metrics: dict[str, object]) -> None:
    metrics["loss-curve"] = [0.5, math.inf, 0.25]


COMMON_KINDS: dict[str, tuple[Callable, str]] = {
    "int8": (_as_dtype(torch.int8), "dtype"),
    "bool": (_as_dtype(torch.bool), "dtype"),
    "nan-loss": (_metric(TRAIN_LOSS, math.nan), "non-finite-metric"),
    "inf-list-metric": (_list_metric, "non-finite-metric"),
    "nan": (_nan, "non-finite"),
    "inf": (_inf, "non-finite"),
    "wrong-shape": (_wide, "shape"),
    "missing-key": (_missing_key, "missing-key"),
    "extra-key": (_extra_key, "extra-key"),
    "no-record": (_no_record, "missing-record"),
    "scaled-update": (_scaled_update, "update-norm"),
    "client-dp-epsilon": (_metric("dp-epsilon", 0.01), "reserved-metric"),
    "client-drop-count": (_metric("dropped-update-norm", 0.0), "reserved-metric"),
    "client-secure-sums": (_metric("secure-sums", 3.0), "reserved-metric"),
    "client-upload-leak": (_metric("upload-personal-psnr", 40.0), "reserved-metric"),
    "client-num-replies": (_metric(NUM_REPLIES, 1e6), "reserved-metric"),
}
WEIGHT_KINDS: dict[str, tuple[Callable, str]] = {
    "zero-examples": (_metric(NUM_EXAMPLES, 0.0), NUM_EXAMPLES),
    "negative-examples": (_metric(NUM_EXAMPLES, -4.0), NUM_EXAMPLES),
    "nan-examples": (_metric(NUM_EXAMPLES, float("nan")), "non-finite-metric"),
    "missing-examples": (_metric(NUM_EXAMPLES, None), NUM_EXAMPLES),
    "absurd-examples": (_metric(NUM_EXAMPLES, 1e12), NUM_EXAMPLES),
}
SPECIFIC_KINDS: dict[str, dict[str, tuple[Callable, str]]] = {
    "fednova": {
        "zero-steps": (_metric(TRAIN_STEPS, 0.0), TRAIN_STEPS),
        "more-steps-than-sent": (_metric(TRAIN_STEPS, NOVA_STEPS + 1.0), TRAIN_STEPS),
        "million-steps": (_metric(TRAIN_STEPS, 1e6), TRAIN_STEPS),
        "fraction-of-a-step": (_metric(TRAIN_STEPS, 1e-6), TRAIN_STEPS),
    },
    "scaffold": {
        "nan-control": (_set(CONTROL_DELTA, "bias", torch.tensor([0.0, math.nan])), "non-finite"),
        "huge-control": (_set(CONTROL_DELTA, "bias", torch.tensor([0.0, 1e30])), "control-norm"),
    },
    "decentnerf": {
        "negative-alpha": (_alpha(-1.0), "alpha"),
        "zero-alpha": (_alpha(0.0), "alpha"),
        "huge-alpha": (_alpha(1e4), "alpha"),
    },
}


def cases() -> list[tuple[str, str, Callable, str]]:
    found = []
    for name in (*WEIGHTED, "scaffold", "decentnerf"):
        kinds = {**COMMON_KINDS, **SPECIFIC_KINDS.get(name, {})}
        if name in WEIGHTED:
            kinds.update(WEIGHT_KINDS)
        found += [(name, kind, corrupt, check) for kind, (corrupt, check) in kinds.items()]
    return found


def assert_same_arrays(got: ArrayRecord | None, expected: ArrayRecord | None) -> None:
    assert got is not None and expected is not None
    got_state, expected_state = arrays_to_state(got), arrays_to_state(expected)
    assert list(got_state) == list(expected_state)
    for key, value in expected_state.items():
        assert bool(torch.isfinite(got_state[key]).all())
        # the same replies in another arrival order: equal up to float64 rounding
        torch.testing.assert_close(got_state[key], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "kind", "corrupt", "check"), cases(), ids=[f"{c[0]}-{c[1]}" for c in cases()]
)
def test_a_bad_reply_is_dropped_and_the_honest_ones_aggregate(
    name: str, kind: str, corrupt: Callable, check: str, caplog: pytest.LogCaptureFixture
) -> None:
    honest = [honest_reply(name, k) for k in range(HONEST)]
    records, metrics = honest_reply(name, HONEST)
    corrupt(records, metrics)
    # the bad node replies second: the honest replies after it must still be folded in
    replies = [honest[0], (records, metrics), *honest[1:]]
    with caplog.at_level(logging.WARNING):
        arrays, round_metrics, strategy = run_round(name, replies)
    expected, expected_metrics, alone = run_round(name, honest)
    assert_same_arrays(arrays, expected)
    assert round_metrics[NUM_REPLIES] == HONEST
    assert round_metrics[NUM_FAILURES] == 1 and round_metrics[NUM_DROPPED] == 1
    assert round_metrics[f"dropped-{check}"] == 1
    assert round_metrics.get(TRAIN_LOSS) == expected_metrics.get(TRAIN_LOSS)
    if isinstance(strategy, Scaffold) and isinstance(alone, Scaffold):
        # c <- c + sum_i delta c_i / N, N the connected nodes: 4 here, 3 alone
        for key, value in alone.method.server_control.items():
            expected_control = value * HONEST / (HONEST + 1)
            torch.testing.assert_close(
                strategy.method.server_control[key], expected_control, rtol=1e-12, atol=1e-12
            )
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "node 102" in dropped[0] and check in dropped[0]


def test_a_drop_logs_node_and_check_but_no_value(caplog: pytest.LogCaptureFixture) -> None:
    records, metrics = honest_reply("fedavg", 1)
    metrics[NUM_EXAMPLES] = 123456789012.0
    with caplog.at_level(logging.WARNING):
        run_round("fedavg", [honest_reply("fedavg", 0), (records, metrics)])
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "node 102" in message and "'num-examples'" in message
    assert "123456789012" not in message and "1.23456789012e+11" not in message


def test_a_node_silent_past_the_timeout_is_counted_missing_not_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Of three sampled nodes one replies, one fails and one sends nothing before the timeout
    (a node under load, say): the round sums the one, counts one failure and one missing with a
    WARNING naming round-timeout; a round where every node answered reports no num-missing."""
    replies = [honest_reply("fedavg", k) for k in range(3)]
    strategy = make("fedavg", 3)
    grid = InProcessGrid([node(*replies[0]), _failing, node(*replies[2])])
    grid.offline.add(103)
    messages = strategy.configure_train(1, state_to_arrays(global_state()), ConfigRecord(), grid)
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is not None and metrics is not None
    assert (metrics[NUM_REPLIES], metrics[NUM_FAILURES], metrics[NUM_MISSING]) == (1, 1, 1)
    assert reply_counts(dict(metrics)) == "1 replies, 1 failures, 1 missing"  # the log line
    assert any("node" in r.getMessage() and "[103]" in r.getMessage()
               and "round-timeout" in r.getMessage() for r in caplog.records)  # fmt: skip
    assert_same_arrays(arrays, state_to_arrays(honest_state(0)))
    _, every, _ = run_round("fedavg", replies)
    assert NUM_MISSING not in every


def _failing(message: Message, context: Context) -> Message:
    """A node whose ClientApp raises (the grid answers with an Error), but for the user key."""
    if message.metadata.message_type == USER_KEY_MESSAGE_TYPE:
        return answer_user_key(message, context)
    raise RuntimeError("the ClientApp failed")


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "decentnerf", "fednova"])
def test_with_every_reply_bad_the_global_model_stays(name: str) -> None:
    replies = []
    for k in range(HONEST):
        records, metrics = honest_reply(name, k)
        _nan(records, metrics)
        replies.append((records, metrics))
    arrays, metrics, strategy = run_round(name, replies)
    assert arrays is None  # Flower keeps the global model
    assert metrics[NUM_REPLIES] == 0 and metrics[NUM_DROPPED] == HONEST
    if isinstance(strategy, Scaffold):
        assert all(not c.any() for c in strategy.method.server_control.values())


def test_a_reply_just_inside_the_bounds_is_kept() -> None:
    """The caps are inclusive and relative to max(||g||, 1): a move of exactly the bound is
    aggregated, num-examples at the cap too."""
    start = global_state()
    bound = 2.0 * max(update_norm(start), 1.0)
    direction = {k: torch.ones_like(v) for k, v in start.items()}
    length = update_norm(direction)
    moved = {k: start[k] + direction[k] * (bound * 0.999 / length) for k in start}
    replies = [({ARRAYS: moved}, {NUM_EXAMPLES: 50.0}), honest_reply("fedavg", 0)]
    _, metrics, _ = run_round("fedavg", replies, max_update_norm=2.0, max_num_examples=50.0)
    assert metrics[NUM_REPLIES] == 2 and metrics[NUM_DROPPED] == 0
    too_far = {k: start[k] + direction[k] * (bound * 1.001 / length) for k in start}
    replies = [({ARRAYS: too_far}, {NUM_EXAMPLES: 50.0}), honest_reply("fedavg", 0)]
    _, metrics, _ = run_round("fedavg", replies, max_update_norm=2.0, max_num_examples=50.0)
    assert metrics[NUM_REPLIES] == 1 and metrics["dropped-update-norm"] == 1
    replies = [({ARRAYS: moved}, {NUM_EXAMPLES: 50.0}), honest_reply("fedavg", 0)]
    _, metrics, _ = run_round("fedavg", replies, max_update_norm=2.0, max_num_examples=49.0)
    assert metrics[NUM_REPLIES] == 1 and metrics[f"dropped-{NUM_EXAMPLES}"] == 1


def test_disabled_bounds_let_an_outlier_through() -> None:
    records, metrics = honest_reply("fedavg", 3)
    _scaled_update(records, metrics)
    metrics[NUM_EXAMPLES] = 1e12
    replies = [honest_reply("fedavg", 0), (records, metrics)]
    arrays, round_metrics, _ = run_round("fedavg", replies, max_update_norm=0, max_num_examples=0)
    assert round_metrics[NUM_REPLIES] == 2 and round_metrics[NUM_DROPPED] == 0
    assert arrays is not None
    assert update_norm(arrays_to_state(arrays), global_state()) > 1e4


def gradient_round(gradients: list[State], **options: object) -> tuple[State | None, dict]:
    """Round 2 of DecentNeRF with nodes answering the gradient query with `gradients`: the G
    its train messages carry (None if none) and the round's drop counts."""
    strategy = DecentNeRF(min_available_nodes=len(gradients), **options)
    grid = InProcessGrid([node({GRADIENT: g}, {}) for g in gradients])
    messages = list(
        strategy.configure_train(2, state_to_arrays(global_state()), ConfigRecord(), grid)
    )
    carried = [arrays_to_state(m.content[GRADIENT]) for m in messages if GRADIENT in m.content]
    assert not carried or len(carried) == len(messages)
    return (carried[0] if carried else None), dict(strategy.round_of(2).ledger.dropped)


def test_an_oversized_gradient_reply_is_dropped_from_g() -> None:
    """||G_k|| above max-gradient-norm (inclusive) is left out of G = sum_k G_k: G equals the
    honest users' sum, computed here directly, and the drop is counted."""
    honest = [honest_state(k, scale=1.0) for k in range(HONEST)]
    expected = {key: sum(g[key] for g in honest) for key in honest[0]}
    bound = max(update_norm(g) for g in honest)
    poisoned = {key: 1e6 * value for key, value in honest[0].items()}
    gradient, dropped = gradient_round([*honest, poisoned], max_gradient_norm=bound)
    assert gradient is not None and dropped == {"gradient-norm": 1}
    assert max_distance(gradient, expected) < 1e-12
    gradient, dropped = gradient_round([*honest, poisoned], max_gradient_norm=0)  # no cap
    assert gradient is not None and dropped == {}
    assert max_distance(gradient, expected) > 1e5
    _, dropped = gradient_round(honest, max_gradient_norm=bound * (1 - 1e-9))
    assert dropped == {"gradient-norm": 1}  # the largest honest one, just above the cap


# ------------------------------------------------------------------ robust aggregation


def poisoned_round(name: str, rule: str, **options: object) -> tuple[State, State, MetricRecord]:
    """5 clients with equal weights, client 3 sending g + 1e6 (g_3 - g); the round's result
    and the honest clients' mean."""
    replies = []
    for k in range(5):
        records = {ARRAYS: honest_state(k, scale=1e-4)}
        metrics = {NUM_EXAMPLES: 100.0, TRAIN_LOSS: 1.0}
        if k == 3:
            _scaled_update(records, metrics)
        replies.append((records, metrics))
    honest = [records[ARRAYS] for k, (records, _) in enumerate(replies) if k != 3]
    honest_mean = {key: torch.stack([s[key] for s in honest]).mean(0) for key in honest[0]}
    arrays, metrics, _ = run_round(name, replies, aggregation_rule=rule, **options)
    assert arrays is not None
    return arrays_to_state(arrays), honest_mean, metrics


def max_distance(first: State, second: State) -> float:
    return max(float((first[k] - second[k]).abs().max()) for k in first)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedmenf"])
def test_a_scaled_update_ruins_the_mean_but_not_median_or_trimmed_mean(name: str) -> None:
    mean, honest_mean, _ = poisoned_round(name, "mean", max_update_norm=0)
    assert max_distance(mean, honest_mean) > 1.0
    for rule in ("median", "trimmed-mean"):
        robust, honest_mean, metrics = poisoned_round(name, rule, max_update_norm=0)
        assert metrics[NUM_REPLIES] == 5 and metrics[NUM_DROPPED] == 0
        assert max_distance(robust, honest_mean) < 1e-3, rule


def test_max_update_norm_drops_the_scaled_update_from_the_mean() -> None:
    # honest updates move g by ~1e-4 x ||g||, the scaled one by ~1e2 x ||g||
    mean, honest_mean, metrics = poisoned_round("fedavg", "mean", max_update_norm=10.0)
    assert metrics["dropped-update-norm"] == 1 and metrics[NUM_REPLIES] == 4
    assert max_distance(mean, honest_mean) < 1e-12


def test_fedacg_moves_from_the_robust_aggregate() -> None:
    robust, honest_mean, _ = poisoned_round("fedacg", "median", max_update_norm=0)
    assert max_distance(robust, honest_mean) < 1e-3  # first round: momentum starts at 0


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7, 10])
def test_median_and_trimmed_mean_equal_numpy_and_scipy(count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    states = [
        {"a": torch.randn(4, 3, generator=gen, dtype=F64), "b": torch.randn(5, generator=gen)}
        for _ in range(count)
    ]
    stacked = {key: np.stack([s[key].numpy() for s in states]) for key in states[0]}
    median = coordinate_median(states)
    for key, values in stacked.items():
        np.testing.assert_allclose(median[key].numpy(), np.median(values, axis=0), rtol=1e-6)
        assert median[key].dtype == states[0][key].dtype
    for fraction in (0.0, 0.1, 0.2, 0.25, 0.4, 0.49):
        trimmed = coordinate_trimmed_mean(states, fraction)
        for key, values in stacked.items():
            expected = stats.trim_mean(values, fraction, axis=0)
            np.testing.assert_allclose(trimmed[key].numpy(), expected, rtol=1e-6, atol=1e-7)
    assert robust_aggregate(RobustRule("median"), states)["a"].equal(median["a"])


def test_robust_rules_round_integer_tensors_and_refuse_bad_arguments() -> None:
    states = [{"steps": torch.tensor([1, 4])}, {"steps": torch.tensor([2, 7])}]
    assert coordinate_median(states)["steps"].tolist() == [2, 6]  # 1.5 -> 2, 5.5 -> 6
    with pytest.raises(ValueError, match=r"trim_fraction must be in \[0, 0.5\)"):
        coordinate_trimmed_mean(states, 0.5)
    with pytest.raises(ValueError, match="robust rule must be one of"):
        robust_aggregate(RobustRule("mean"), states)
    with pytest.raises(ValueError, match="shape"):
        coordinate_median([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}])


def test_update_norm_is_the_euclidean_distance() -> None:
    start, moved = global_state(), honest_state(5)
    flat = torch.cat([(moved[k] - start[k]).flatten() for k in start])
    assert update_norm(moved, start) == pytest.approx(float(flat.norm()), rel=1e-12)
    payload = alpha_weighted_payload(moved, 2.5)
    assert update_norm(payload, start, scale=2.5) == pytest.approx(float(flat.norm()), rel=1e-12)


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: FedAvg(aggregation_rule="mode"), "aggregation_rule must be one of"),
        (lambda: FedAvg(trim_fraction=0.5), r"trim_fraction must be in \[0, 0.5\)"),
        (
            lambda: FedProx(
                proximal_mu=0.1,
                aggregation_rule="median",
                secure_aggregation=SecureAggregationConfig(),
            ),
            "secure aggregation hides",
        ),
        (lambda: FedNova(aggregation_rule="median"), "fednova aggregates with its own"),
        (lambda: FedExP(aggregation_rule="trimmed-mean"), "fedexp aggregates with its own"),
        (lambda: FedAvg(max_update_norm=-1.0), "max_update_norm must be > 0"),
        (lambda: FedAvg(max_num_examples=float("inf")), "max_num_examples must be > 0"),
        (lambda: DecentNeRF(alpha_max=0.0), "alpha_max must be positive"),
    ],
)
def test_contradictory_strategy_arguments_are_refused(build: Callable, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_run_config_keys_reach_the_strategies() -> None:
    from fedfields.config import meta_settings
    from simulations.meta_job import make_meta_strategy
    from strategies import make_strategy

    config = parse_app_config(
        {
            "strategy": "fedprox",
            "aggregation-rule": "trimmed-mean",
            "trim-fraction": 0.3,
            "max-update-norm": 5.0,
            "max-num-examples": 0.0,
        }
    )
    fedprox = make_strategy(config)
    assert isinstance(fedprox, FedProx)
    assert (fedprox.aggregation_rule, fedprox.trim_fraction) == ("trimmed-mean", 0.3)
    assert (fedprox.max_update_norm, fedprox.max_num_examples) == (5.0, None)
    scene = parse_app_config({"alpha-max": 7.0})
    decentnerf = make_strategy(scene)
    assert isinstance(decentnerf, DecentNeRF) and decentnerf.method.alpha_max == 7.0
    assert decentnerf.method.max_gradient_norm == 1e4
    capped = parse_app_config({"max-gradient-norm": 0.0})
    assert make_strategy(capped).method.max_gradient_norm is None
    assert decentnerf.max_update_norm == 1000.0 and decentnerf.max_num_examples == 1e9
    faces = parse_app_config({"task": "faces", "aggregation-rule": "median"})
    fedmenf = make_meta_strategy(faces, meta_settings(faces))
    assert isinstance(fedmenf, FedMeNF) and fedmenf.aggregation_rule == "median"


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("name", [*WEIGHTED, "scaffold", "decentnerf"])
@pytest.mark.parametrize("reply_dtype", [torch.float16, torch.float32])
def test_float_replies_are_cast_to_the_globals_dtype(name: str, reply_dtype: torch.dtype) -> None:
    """A narrower float reply first must not decide the global's dtype: every reply is cast
    to the global's float64, so the round equals the one of the same values sent as float64."""
    honest = [honest_reply(name, k) for k in range(HONEST)]
    narrow = [
        ({r: {k: v.to(reply_dtype) for k, v in st.items()} for r, st in records.items()}, metrics)
        for records, metrics in honest
    ]
    widened = [
        ({r: {k: v.double() for k, v in st.items()} for r, st in records.items()}, metrics)
        for records, metrics in narrow
    ]
    arrays, metrics, _ = run_round(name, narrow)
    expected, _, _ = run_round(name, widened)
    assert metrics[NUM_DROPPED] == 0 and metrics[NUM_REPLIES] == HONEST
    assert {a.dtype for a in arrays_to_state(arrays).values()} == {F64}
    assert_same_arrays(arrays, expected)


def test_a_float32_global_stays_float32_under_float64_replies() -> None:
    strategy = FedAvg(min_available_nodes=2)
    start = {k: v.float() for k, v in global_state().items()}
    grid = InProcessGrid([node(*honest_reply("fedavg", k)) for k in range(2)])
    messages = strategy.configure_train(1, state_to_arrays(start), ConfigRecord(), grid)
    arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is not None
    assert {a.dtype for a in arrays_to_state(arrays).values()} == {torch.float32}


# ------------------------------------------------------------------ secure mode


def secure_node(records: dict[str, State], metrics: dict[str, float]) -> ClientApp:
    """A ClientApp behind fedfields' SecAgg+ mod answering every train message the same."""
    app = ClientApp(mods=[secure_aggregation_mod])
    app.query(USER_KEY_ACTION)(answer_user_key)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return node(records, metrics)(message, context)

    return app


def secure_round(
    name: str, replies: list[tuple[dict[str, State], dict[str, float]]], plain: int = 0
) -> tuple[ArrayRecord | None, MetricRecord, ProtocolStrategy]:
    """One secure round; the first `plain` nodes lack the SecAgg+ mod (hold nothing back)."""
    strategy = make(name, len(replies), secure_aggregation=SecureAggregationConfig())
    nodes = [node(*reply) if k < plain else secure_node(*reply) for k, reply in enumerate(replies)]
    grid = InProcessGrid(nodes)
    messages = strategy.configure_train(1, state_to_arrays(global_state()), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert metrics is not None
    return arrays, metrics, strategy


def test_a_secure_reply_that_holds_nothing_back_is_dropped_and_the_rest_aggregate() -> None:
    honest = [honest_reply("fedavg", k) for k in range(HONEST)]
    arrays, metrics, _ = secure_round("fedavg", [honest_reply("fedavg", 3), *honest], plain=1)
    expected, _, _ = run_round("fedavg", honest)
    assert metrics["dropped-held"] == 1 and metrics[SECURE_SUMS] == 1
    assert metrics[NUM_REPLIES] == HONEST  # the plaintext reply's metrics are left out too
    assert arrays is not None and expected is not None
    got, want = arrays_to_state(arrays), arrays_to_state(expected)
    assert max_distance(got, want) < 1e-6  # SecAgg+ quantisation


def test_a_secure_sum_of_zero_weight_skips_the_round_without_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    replies = [honest_reply("fedavg", k) for k in range(HONEST)]
    for _, metrics in replies:
        metrics[NUM_EXAMPLES] = 0.0  # hidden from the server: only the sum shows it
    arrays, metrics, _ = secure_round("fedavg", replies)
    assert arrays is None and metrics[SECURE_FAILURES] == 1 and metrics[SECURE_SUMS] == 0
    assert "summed weight is not positive" in caplog.text


def test_a_secure_decentnerf_sum_of_non_positive_alpha_skips_the_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    replies = [({ARRAYS: alpha_weighted_payload(honest_state(k), -1.0)}, {}) for k in range(3)]
    arrays, metrics, strategy = secure_round("decentnerf", replies)
    assert arrays is None and metrics[SECURE_FAILURES] == 1
    assert "summed alpha_k is not positive" in caplog.text
    assert isinstance(strategy, DecentNeRF) and strategy.method.last_aggregate is None


def test_secure_empty_rounds_end_the_run_with_the_secure_failure_named() -> None:
    replies = [honest_reply("fedavg", k) for k in range(HONEST)]
    for _, metrics in replies:
        metrics[NUM_EXAMPLES] = 0.0
    strategy = make("fedavg", HONEST, secure_aggregation=SecureAggregationConfig())
    grid = InProcessGrid([secure_node(*reply) for reply in replies])
    with pytest.raises(EmptyRoundsError, match="summed weight is not positive") as raised:
        strategy.start(grid, state_to_arrays(global_state()), num_rounds=1)
    assert "1 secure sums failed" in str(raised.value)


# ------------------------------------------------------------------ empty rounds


def quickstart_node(message: Message, context: Context) -> Message:
    """A Flower quickstart-pytorch style client: its state back, "train_loss" and
    "num-examples" only (no "train-steps")."""
    state = arrays_to_state(message.content[ARRAYS])
    metrics = MetricRecord({"train_loss": 0.5, NUM_EXAMPLES: 50})
    return Message(RecordDict({ARRAYS: state_to_arrays(state), METRICS: metrics}), reply_to=message)


def test_fednova_with_quickstart_clients_stops_after_max_empty_rounds() -> None:
    strategy = FedNova(min_available_nodes=3, max_empty_rounds=3)
    grid = InProcessGrid([quickstart_node] * 3)
    rounds: list[int] = []
    with pytest.raises(EmptyRoundsError) as raised:
        strategy.start(
            grid,
            state_to_arrays(global_state()),
            num_rounds=10,
            evaluate_fn=lambda r, _: rounds.append(r),  # type: ignore[func-returns-value]
        )
    message = str(raised.value)
    assert rounds == [0, 1, 2, 3]  # rounds 4-10 never ran
    assert "3 consecutive rounds (1-3)" in message and "max-empty-rounds = 3" in message
    assert "9 replies asked, 0 kept, 9 dropped (dropped-train-steps 9)" in message
    assert "the clients must report 'train-steps'" in message


def test_a_run_that_never_aggregated_fails_even_below_max_empty_rounds() -> None:
    strategy = FedAvg(min_available_nodes=3, max_update_norm=1e-12, max_empty_rounds=3)
    grid = InProcessGrid([node(*honest_reply("fedavg", k)) for k in range(3)])
    with pytest.raises(EmptyRoundsError) as raised:
        strategy.start(grid, state_to_arrays(global_state()), num_rounds=2)
    message = str(raised.value)
    assert "no round of this run formed an aggregate (rounds 1-2)" in message
    assert "dropped-update-norm 6" in message
    assert "updates exceeded max-update-norm = 1e-12" in message
    unlimited = FedAvg(min_available_nodes=3, max_update_norm=1e-12, max_empty_rounds=0)
    with pytest.raises(EmptyRoundsError, match="never changed"):
        unlimited.start(grid, state_to_arrays(global_state()), num_rounds=4)
    assert unlimited.rounds_started == 4  # 0: no early stop


def test_empty_rounds_must_be_consecutive_to_end_a_run() -> None:
    """Rounds 1, 3 and 5 drop everything (a NaN metric), 2 and 4 aggregate: never two empty
    rounds in a row, so max-empty-rounds = 2 lets the run complete."""
    honest = node(*honest_reply("fedavg", 0))

    def flaky(message: Message, context: Context) -> Message:
        reply = honest(message, context)
        if int(message.content["config"]["server-round"]) % 2:
            reply.content[METRICS][TRAIN_LOSS] = math.nan
        return reply

    strategy = FedAvg(min_available_nodes=2, max_empty_rounds=2)
    result = strategy.start(
        InProcessGrid([flaky, flaky]), state_to_arrays(global_state()), num_rounds=5
    )
    assert strategy.rounds_aggregated == 2
    assert [result.train_metrics_clientapp[r]["dropped-non-finite-metric"] for r in (1, 3, 5)] == [
        2,
        2,
        2,
    ]


def test_max_empty_rounds_reaches_the_strategies_from_run_config() -> None:
    from strategies import make_strategy

    config = parse_app_config({"strategy": "fednova", "max-empty-rounds": 5})
    assert make_strategy(config).max_empty_rounds == 5
    assert make_strategy(parse_app_config({"strategy": "fedavg"})).max_empty_rounds == 3
    with pytest.raises(ValueError, match="'max-empty-rounds' must be >= 0"):
        parse_app_config({"max-empty-rounds": -1})
    with pytest.raises(ValueError, match="max_empty_rounds must be >= 0"):
        FedAvg(max_empty_rounds=-2)


# ------------------------------------------------------------------ DecentNeRF alpha clamp


def alpha_after(config: dict[str, float], gradient_scale: float) -> float:
    """A DecentNeRF client's alpha after one update by G = gradient_scale * g_1."""
    set_task_identity()
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    client = DecentNeRFClient(NodeState(context))
    g_1 = {"w": torch.tensor([1.0, 2.0, 3.0])}

    def message(server_round: int, gradient: State | None) -> Message:
        base = {"server-round": server_round, "strategy": "decentnerf", "alpha-lr": 1.0}
        records = {ARRAYS: state_to_arrays(g_1), "config": ConfigRecord({**base, **config})}
        if gradient is not None:
            records[GRADIENT] = state_to_arrays(gradient)
        return Message(RecordDict(records), dst_node_id=7, message_type="train")

    client.train_reply(message(1, None), g_1, {})
    client.train_reply(message(2, {"w": gradient_scale * g_1["w"]}), g_1, {})
    return client.alpha


def test_clients_clamp_alpha_into_the_servers_range() -> None:
    """<G, g_1> = 14 * scale: a large positive G drives alpha far below 0, a negative one
    far above alpha-max; the client keeps it in [alpha-max * ALPHA_FLOOR, alpha-max]."""
    assert alpha_after({"alpha-max": 50.0}, 10.0) == pytest.approx(50.0 * ALPHA_FLOOR)
    assert alpha_after({"alpha-max": 50.0}, -10.0) == 50.0
    assert alpha_after({"alpha-max": 50.0}, 0.01) == pytest.approx(1.0 - 0.14)  # inside
    assert alpha_after({}, -100.0) == DEFAULT_ALPHA_MAX  # an older server: the default
    sent = DecentNeRF(alpha_max=7.0).protocol_config()
    assert sent["alpha-max"] == 7.0


# ------------------------------------------------------------------ split sample replies

SPLIT_RAYS, SPLIT_SAMPLES = 8, 6


def split_samples(count: int = SPLIT_RAYS) -> State:
    gen = torch.Generator().manual_seed(count)
    edges = torch.linspace(2.0, 6.0, SPLIT_SAMPLES + 1).expand(count, -1).clone()
    origins = torch.randn(count, 3, generator=gen)
    return {"origins": origins, "directions": torch.randn(count, 3, generator=gen), "edges": edges}


SPLIT_KINDS: dict[str, tuple[Callable[[State], State], str]] = {
    "too-many-rays": (lambda s: split_samples(SPLIT_RAYS + 1), "batch-size"),
    "missing-edges": (lambda s: {k: v for k, v in s.items() if k != "edges"}, "missing-key"),
    "extra-key": (lambda s: {**s, "colors": torch.zeros(SPLIT_RAYS, 3)}, "extra-key"),
    "wrong-samples": (lambda s: {**s, "edges": torch.ones(SPLIT_RAYS, SPLIT_SAMPLES)}, "shape"),
    "ragged-directions": (lambda s: {**s, "directions": torch.ones(SPLIT_RAYS - 1, 3)}, "shape"),
    "nan-origin": (
        lambda s: {**s, "origins": s["origins"].index_fill(0, torch.tensor([2]), math.nan)},
        "non-finite",
    ),  # fmt: skip
    "int-edges": (lambda s: {**s, "edges": s["edges"].to(torch.int32)}, "dtype"),
}


def split_reply(samples: State) -> Message:
    set_task_identity()
    sent = Message(RecordDict(), dst_node_id=7, message_type="train")
    return Message(RecordDict({SAMPLES: state_to_arrays(samples)}), reply_to=sent)


@pytest.mark.parametrize("kind", list(SPLIT_KINDS))
def test_a_bad_split_sample_reply_is_refused_by_its_check(kind: str) -> None:
    change, check = SPLIT_KINDS[kind]
    with pytest.raises(BadReply) as raised:
        checked_samples(split_reply(change(split_samples())), SPLIT_RAYS, SPLIT_SAMPLES)
    assert raised.value.check == check


def test_a_good_split_sample_reply_passes_cast_to_float32() -> None:
    sent = {k: v.double() for k, v in split_samples(SPLIT_RAYS - 3).items()}  # a smaller batch
    rays = checked_samples(split_reply(sent), SPLIT_RAYS, SPLIT_SAMPLES)
    assert {v.dtype for v in rays.values()} == {torch.float32}
    assert torch.equal(rays["edges"], sent["edges"].float())


def test_the_split_server_stops_at_a_bad_sample_reply_with_one_error(tmp_path: Path) -> None:
    """A client whose first batch holds 1000 rays, above split-batch-rays: the server never
    embeds it; the run stops with one EmptyRoundsError naming the check and the cap."""
    config = {
        "mode": "split",
        "run-dir": str(tmp_path / "run"),
        "split-batch-rays": SPLIT_RAYS,
        "split-samples": SPLIT_SAMPLES,
        "hash-log2-size": 10,
        "hash-levels": 2,
    }

    def flooding(message: Message, context: Context) -> Message:
        content = RecordDict({SAMPLES: state_to_arrays(split_samples(1000))})
        return Message(content, reply_to=message)

    with pytest.raises(EmptyRoundsError, match="dropped-batch-size 1") as raised:
        run_split_job(InProcessGrid([flooding]), parse_app_config(config), observers=[])
    assert f"split-batch-rays = {SPLIT_RAYS}" in str(raised.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


# ------------------------------------------------------------------ the launcher


def test_an_all_empty_run_through_the_launcher_exits_non_zero(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """The issue's command (every reply beyond max-update-norm 1e-12, 2 rounds, below
    max-empty-rounds' 3) on the session's 3-user crowd with tiny documented settings: the
    run fails with EmptyRoundsError's line, and the launcher exits non-zero (Ray: ~30-60 s)."""
    run_config = (
        "strategy='fedavg' max-update-norm=1e-12 num-server-rounds=2 local-steps=1 "
        "orbit-frames=0 target-samples=1024 hash-log2-size=10 hash-levels=4 client-eval-views=0"
    )
    command = [sys.executable, "-m", "simulations.launch", "--no-audit", "--crowd", str(crowd_dir)]
    command += ["--run-dir", str(tmp_path / "run"), "--run-config", run_config]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    line = "no round of this run formed an aggregate (rounds 1-2)"
    assert line in output and "updates exceeded max-update-norm = 1e-12" in output, output[-3000:]
    assert "4 replies asked, 0 kept, 4 dropped (dropped-update-norm 4)" in output  # 2 of 3 x 2
    assert not (tmp_path / "run" / "summary.json").exists()  # never reported as completed


def test_each_round_logs_one_line_of_replies_summed_dropped_and_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 56, point 6: run through the strategy's own loop (`start`, as a library user
    calls it), a round of one honest reply, one a check drops and one error logs one INFO
    line with the three counts, as Flower's strategies print theirs."""
    records, metrics = honest_reply("fedavg", 1)
    metrics[NUM_EXAMPLES] = 123456789012.0  # over max_num_examples: dropped
    grid = InProcessGrid([node(*honest_reply("fedavg", 0)), node(records, metrics), _failing])
    with caplog.at_level(logging.INFO):
        make("fedavg", 3).start(grid, state_to_arrays(global_state()), num_rounds=1)
    lines = [r.getMessage() for r in caplog.records if "aggregate_train:" in r.getMessage()]
    assert lines == ["aggregate_train: 1 replies summed, 1 dropped, 1 failed"]
