"""Hostile clients, third round (issue 42, points 1-3): every number a client sends that scales
the aggregate is bounded, checks run on the values as they will be summed (the global's
dtype), every sum's result is checked before it becomes the global, client metrics cannot
take the server's names, and metric means do not overflow.

One hostile node replies beside honest ones; the round must give what the honest nodes alone
give, or keep the global model, and never raise.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from paper_reference import fedexp_update
from test_reply_faults import (
    HONEST,
    NOVA_STEPS,
    WEIGHTED,
    State,
    assert_same_arrays,
    global_state,
    honest_reply,
    make,
    node,
)

from fedfields.flower import EmptyRoundsError, FedExP, FedNova, ProtocolStrategy, Scaffold
from fedfields.flower.protocol import (
    ARRAYS,
    GRADIENT,
    NON_FINITE_AGGREGATE,
    NUM_DROPPED,
    NUM_EXAMPLES,
    NUM_REPLIES,
    TRAIN_LOSS,
    TRAIN_STEPS,
    arrays_to_state,
    reserved_metric,
    state_to_arrays,
)
from fedfields.flower.round import weighted_mean
from fedfields.methods import ALPHA_KEY, alpha_weighted_payload
from fedfields.methods.base import update_norm
from fedfields.methods.fedexp import SERVER_STEP, max_server_step
from fedfields.methods.scaffold import CONTROL_DELTA
from simulations.in_process_grid import InProcessGrid

F32 = torch.float32
NO_CAPS = {"max_update_norm": 0, "max_num_examples": 0}
"""Every cap a user can switch off ("0: no cap")."""


def round_from(
    strategy: ProtocolStrategy,
    replies: list[tuple[dict[str, State], dict[str, float]]],
    sent: State,
) -> tuple[ArrayRecord | None, MetricRecord]:
    grid = InProcessGrid([node(records, metrics) for records, metrics in replies])
    messages = strategy.configure_train(1, state_to_arrays(sent), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert metrics is not None
    return arrays, metrics


def float32_global() -> State:
    return {key: value.to(F32) for key, value in global_state().items()}


def past_float32(records: dict[str, State]) -> None:
    """One entry of the reply's arrays at 1e39 in float64: finite as sent, inf in float32."""
    payload = dict(records[ARRAYS])
    weight = payload["weight"].clone()
    weight[0, 0] = 1e39
    payload["weight"] = weight
    records[ARRAYS] = payload


# ------------------------------------------------------------------ point 2: the dtype summed


@pytest.mark.parametrize("name", [*WEIGHTED, "scaffold", "decentnerf"])
def test_a_float64_value_past_a_float32_global_is_dropped_with_every_cap_off(name: str) -> None:
    """A float64 1e39 in a float32 model: finite when read, inf once cast; with
    max-update-norm=0 it used to reach the sum (FedAvg's global became non-finite)."""
    options = dict(NO_CAPS)
    if name == "scaffold":
        options["max_control_norm"] = 0
    honest = [honest_reply(name, k) for k in range(HONEST)]
    records, metrics = honest_reply(name, HONEST)
    past_float32(records)
    got, got_metrics = round_from(
        make(name, HONEST + 1, **options),
        [*honest[:1], (records, metrics), *honest[1:]],
        float32_global(),
    )
    expected, _ = round_from(make(name, HONEST, **options), honest, float32_global())
    assert got_metrics[NUM_DROPPED] == 1 and got_metrics["dropped-non-finite"] == 1
    assert_same_arrays(got, expected)
    assert all(value.dtype == F32 for value in arrays_to_state(got).values())  # type: ignore[arg-type]


def test_decentnerfs_gradient_past_float32_is_dropped_with_its_cap_off() -> None:
    """A gradient reply G_k with a float64 1e39 entry: G would be inf in every client's
    message with max-gradient-norm=0."""
    strategy = make("decentnerf", HONEST + 1, max_gradient_norm=0, **NO_CAPS)
    gradients = [{k: 0.01 * torch.ones_like(v) for k, v in global_state().items()}] * HONEST
    hostile = {**gradients[0], "bias": torch.tensor([1e39, 0.0], dtype=torch.float64)}
    replies = [({GRADIENT: g}, {}) for g in [*gradients, hostile]]
    grid = InProcessGrid([node(records, metrics) for records, metrics in replies])
    opened = strategy.begin_round(2, state_to_arrays(float32_global()), grid)
    summed = strategy.gradient_sum(opened, state_to_arrays(float32_global()), ConfigRecord(), grid)
    assert summed is not None
    for value in summed.values():
        assert value.dtype == F32 and bool(torch.isfinite(value).all())
        torch.testing.assert_close(value, HONEST * 0.01 * torch.ones_like(value))
    assert opened.ledger.dropped == {"non-finite": 1}


def test_scaffolds_huge_control_delta_never_becomes_the_server_control() -> None:
    """At default settings a 1e30 delta c_i became the c sent to every client, and 1e39 in
    a float32 model ended the run with ValueError out of aggregate_train."""
    honest = [honest_reply("scaffold", k) for k in range(HONEST)]
    for value, check, sent in [
        (1e30, "control-norm", global_state()),
        (1e39, "non-finite", float32_global()),
    ]:
        records, metrics = honest_reply("scaffold", HONEST)
        records[CONTROL_DELTA] = {
            **records[CONTROL_DELTA],
            "bias": torch.tensor([value, 0.0], dtype=torch.float64),
        }
        strategy = make("scaffold", HONEST + 1)
        arrays, metrics_out = round_from(strategy, [*honest, (records, metrics)], sent)
        assert arrays is not None and metrics_out[f"dropped-{check}"] == 1
        assert isinstance(strategy, Scaffold)
        alone = make("scaffold", HONEST)
        round_from(alone, honest, sent)
        assert isinstance(alone, Scaffold)
        for key, value in alone.method.server_control.items():  # c <- c + sum delta c_i / N
            expected = value * HONEST / (HONEST + 1)
            torch.testing.assert_close(strategy.method.server_control[key], expected)


# ------------------------------------------------------------------ point 1: client numbers


def test_fednova_takes_train_steps_from_one_to_the_local_steps_sent() -> None:
    """tau_i in [1, local-steps]: both ends are kept, 1e6 against local-steps 1 is dropped
    (it moved the global 6.6e3 away from the honest-only result)."""
    honest = [honest_reply("fednova", k) for k in range(HONEST)]
    for steps, kept in [
        (1.0, True),
        (float(NOVA_STEPS), True),
        (0.999, False),
        (NOVA_STEPS + 0.5, False),
    ]:
        records, metrics = honest_reply("fednova", HONEST)
        metrics[TRAIN_STEPS] = steps
        _, got = round_from(
            make("fednova", HONEST + 1), [*honest, (records, metrics)], global_state()
        )
        assert got[NUM_REPLIES] == HONEST + kept, steps
    single = FedNova(min_available_nodes=HONEST + 1, local_steps=1, **NO_CAPS)
    records, metrics = honest_reply("fednova", HONEST)
    metrics[TRAIN_STEPS] = 1e6
    honest_steps = [(r, {**m, TRAIN_STEPS: 1.0}) for r, m in honest]
    arrays, got = round_from(single, [*honest_steps, (records, metrics)], global_state())
    expected, _ = round_from(
        FedNova(min_available_nodes=HONEST, local_steps=1), honest_steps, global_state()
    )
    assert got[f"dropped-{TRAIN_STEPS}"] == 1
    assert_same_arrays(arrays, expected)


def colluding_pair(scale: float) -> list[tuple[dict[str, State], dict[str, float]]]:
    """Two replies moving the global by +v and -v: each within the update cap, their mean 0."""
    start = global_state()
    direction = {k: scale * torch.ones_like(v) for k, v in start.items()}
    return [
        ({ARRAYS: {k: start[k] + sign * direction[k] for k in start}}, {NUM_EXAMPLES: 10.0})
        for sign in (1.0, -1.0)
    ]


def test_two_colluding_clients_cannot_blow_up_fedexps_server_step() -> None:
    """Opposite updates within the update cap drove eta_g to 2.2e8; it is capped at M/2, its
    value for M orthogonal updates of equal norm."""
    honest = [
        ({ARRAYS: {k: v + 1e-6 for k, v in global_state().items()}}, {NUM_EXAMPLES: 10.0})
    ] * 3
    replies = [*honest, *colluding_pair(10.0)]
    strategy = FedExP(min_available_nodes=len(replies), epsilon=1e-12)
    arrays, metrics = round_from(strategy, replies, global_state())
    assert metrics[SERVER_STEP] == max_server_step(len(replies)) == 2.5
    assert arrays is not None
    assert update_norm(arrays_to_state(arrays), global_state()) < 1e-4  # 2.5 x the tiny mean


def test_fedexps_cap_is_reached_by_orthogonal_updates_of_equal_norm() -> None:
    """The cap is FedExP's own value at orthogonality: M equal orthogonal updates give M/2
    (eps -> 0), so an honest round is never cut below it."""
    x = {"w": torch.zeros(4, dtype=torch.float64)}
    ys = [{"w": torch.eye(4, dtype=torch.float64)[i]} for i in range(4)]
    _, step = fedexp_update(x, ys, [1.0] * 4, epsilon=1e-12)
    assert step == pytest.approx(2.0) and max_server_step(4) == 2.0


@pytest.mark.parametrize("alpha", [1e-300, 5e-324])
def test_decentnerf_alpha_is_bounded_below_by_its_floor(alpha: float) -> None:
    """alpha_k divides the payload in the update-norm check: a subnormal alpha_k with a
    payload near 0 would make g_k = payload / alpha_k overflow; it is dropped."""
    payload = alpha_weighted_payload(global_state(), 1.0)
    payload = {
        k: v * alpha if k != ALPHA_KEY else torch.tensor([alpha], dtype=torch.float64)
        for k, v in payload.items()
    }
    honest = [honest_reply("decentnerf", k) for k in range(HONEST)]
    _, metrics = round_from(
        make("decentnerf", HONEST + 1), [*honest, ({ARRAYS: payload}, {})], global_state()
    )
    assert metrics[NUM_REPLIES] == HONEST and metrics[NUM_DROPPED] == 1


# ------------------------------------------------------------------ the sum's result


def test_an_aggregate_past_the_globals_dtype_is_refused_and_the_global_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Finite float32 replies near the dtype's limit, every cap off: FedNova's normalised step
    (tau_eff / tau_i up to 8) extrapolates past float32. The round is refused, counted, and
    the run says why."""
    start = float32_global()
    big = {k: torch.full_like(v, 3e38) for k, v in start.items()}
    replies = [
        ({ARRAYS: big}, {NUM_EXAMPLES: 10.0, TRAIN_STEPS: 1.0}),
        ({ARRAYS: big}, {NUM_EXAMPLES: 10.0, TRAIN_STEPS: 8.0}),
    ]
    strategy = FedNova(min_available_nodes=2, local_steps=8, max_empty_rounds=1, **NO_CAPS)
    with caplog.at_level(logging.ERROR), pytest.raises(EmptyRoundsError) as raised:
        strategy.start(
            InProcessGrid([node(*r) for r in replies]), state_to_arrays(start), num_rounds=2
        )
    assert "NaN or infinite values in the global model's dtypes" in str(raised.value)
    assert any("aggregate holds NaN or infinite" in r.getMessage() for r in caplog.records)
    assert strategy.rounds_aggregated == 0


# ------------------------------------------------------------------ point 3: metric names


def test_reserved_names_are_the_servers_and_nothing_a_client_sends() -> None:
    for name in [
        "dp-epsilon",
        "dropped-update-norm",
        "secure-sums",
        "upload-personal-psnr",
        "users-sampled",
        "fedexp-server-step",
        NUM_REPLIES,
        "num-missing",
        NON_FINITE_AGGREGATE,
        "round",
        "seconds",
    ]:
        assert reserved_metric(name), name
    for name in [
        NUM_EXAMPLES,
        TRAIN_LOSS,
        TRAIN_STEPS,
        "train-psnr",
        "client-eval-psnr",
        "client-seconds",
        "gamma",
    ]:
        assert not reserved_metric(name), name


def test_metric_means_do_not_overflow() -> None:
    """Two clients' 1e308 train-loss average to 1e308 (the weighted sum was inf), and huge
    weights do not overflow either; ordinary means are unchanged."""
    assert weighted_mean([(1.0, 1e308), (3.0, 1e308)]) == 1e308
    assert weighted_mean([(1e308, 2.0), (1e308, 4.0)]) == pytest.approx(3.0)
    assert weighted_mean([(1.0, -1e308), (1.0, 1e308)]) == 0.0
    assert weighted_mean([(1.0, 2.0), (3.0, 4.0)]) == pytest.approx(3.5, rel=1e-15)
    honest = [honest_reply("fedavg", k) for k in range(2)]
    for _, metrics in honest:
        metrics[TRAIN_LOSS] = 1e308
    _, metrics = round_from(make("fedavg", 2), honest, global_state())
    assert math.isfinite(metrics[TRAIN_LOSS]) and metrics[TRAIN_LOSS] == pytest.approx(1e308)


@pytest.mark.parametrize("weight", [5e-324, 1e-300, 1e-7])
def test_replies_weighted_below_the_floor_are_dropped_and_the_mean_stays_exact(
    weight: float,
) -> None:
    """Every reply but one carries a num-examples below `MIN_NUM_EXAMPLES` (5e-324 made the
    weighted mean of such replies wrong by 0.44): each is dropped and counted, and the round's
    mean is the one reply left, exactly; at the floor a reply is summed."""
    from fedfields.flower.round import MIN_NUM_EXAMPLES

    replies = [honest_reply("fedavg", k) for k in range(HONEST)]
    tiny = [(records, {**metrics, NUM_EXAMPLES: weight}) for records, metrics in replies[1:]]
    got, metrics = round_from(make("fedavg", HONEST), [replies[0], *tiny], global_state())
    assert metrics[NUM_DROPPED] == HONEST - 1
    assert_same_arrays(got, state_to_arrays(replies[0][0][ARRAYS]))
    at_floor = [(records, {**m, NUM_EXAMPLES: MIN_NUM_EXAMPLES}) for records, m in replies]
    _, metrics = round_from(make("fedavg", HONEST), at_floor, global_state())
    assert metrics[NUM_DROPPED] == 0
