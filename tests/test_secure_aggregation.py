"""Secure aggregation: Flower SecAgg+ sums for every strategy, against their plaintext rounds.

The clients are test_strategies' least-squares ClientApps with `secure_aggregation_mod`; the
grid is in-process, so every message the server receives can be searched for secrets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from test_strategies import (
    Produced,
    heterogeneous_problems,
    initial_state,
    least_squares_app,
)
from torch import Tensor

from fedfields.flower import (
    DecentNeRF,
    EmptyRoundsError,
    FedACG,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedYogi,
    ProtocolStrategy,
    Scaffold,
)
from fedfields.flower.protocol import ARRAYS, GRADIENT_QUERY, arrays_to_state, state_to_arrays
from fedfields.flower.round import SECURE_FAILURES, SECURE_SUMS, RoundOutcome
from fedfields.flower.secure_aggregation import secure_aggregation_mod
from fedfields.methods import ALPHA_KEY
from fedfields.privacy.secagg_plan import (
    EXPONENT_MIN,
    NUM_BUCKETS,
    SecureAggregationConfig,
    decode_layout,
    encode_layout,
    exponent_bound,
    exponent_one_hot,
    payload_layout,
    scaled_vectors,
    scales_from_histograms,
)
from simulations.in_process_grid import InProcessGrid

SECURE = SecureAggregationConfig()
ALPHAS = (0.3172, 0.8413, 1.2718, 0.5561, 0.9034)


# ------------------------------------------------------------------ planning maths


@pytest.mark.parametrize(
    ("peak", "exponent"),
    [(1.0, 0), (0.75, 0), (1.5, 1), (2.0, 1), (2.0001, 2), (3e-5, -15), (0.0, EXPONENT_MIN)],
)
def test_exponent_bound_is_the_smallest_power_of_two_above_the_peak(
    peak: float, exponent: int
) -> None:
    tensor = torch.tensor([0.1 * peak, -peak, 0.5 * peak])
    assert exponent_bound(tensor) == exponent
    assert peak <= 2.0**exponent
    assert peak == 0.0 or peak > 2.0 ** (exponent - 1)


def test_scales_come_from_the_largest_occupied_bucket_of_summed_one_hots() -> None:
    clients = [torch.tensor([0.3]), torch.tensor([-5.0]), torch.tensor([0.01])]
    histogram = sum(exponent_one_hot(t) for t in clients)
    assert histogram.shape == (NUM_BUCKETS,) and histogram.sum() == 3
    (scale,) = scales_from_histograms([histogram])
    assert scale == 8.0  # 5 <= 8, and 4 would clip
    vectors = [scaled_vectors({"r": {"k": t}}, [("r", "k", (1,))], [scale], 1.0) for t in clients]
    assert max(abs(v[0]).max() for v in vectors) <= 1.0


def test_a_fixed_clipping_range_is_refused_rather_than_clipped() -> None:
    payload = {"arrays": {"w": torch.tensor([0.5, -9.0])}}
    with pytest.raises(ValueError, match=r"arrays/w has values beyond the SecAgg\+ clipping"):
        scaled_vectors(payload, [("arrays", "w", (2,))], [1.0], 8.0)


def test_quantisation_never_lets_the_modular_sum_overflow() -> None:
    config = SecureAggregationConfig(modulus_range=2**32)
    for clients in (2, 5, 20, 50, 1000):
        levels = config.quantization_range(clients)
        assert clients * levels < 2**32 <= clients * (levels + 1)
    with pytest.raises(ValueError, match="5000 clients leave .* quantisation levels"):
        config.quantization_range(5000)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_shares": 0.0}, "secagg-num-shares"),
        ({"num_shares": 2}, "secagg-num-shares"),
        ({"reconstruction_threshold": 1.5}, "secagg-reconstruction-threshold"),
        ({"num_shares": 5, "reconstruction_threshold": 5}, "secagg-reconstruction-threshold"),
        ({"clipping_range": -1.0}, "secagg-clipping-range"),
        ({"modulus_range": 3 * 2**30}, "secagg-modulus-range"),
        ({"timeout": float("nan")}, "secagg-timeout"),
    ],
)
def test_bad_secagg_settings_name_their_key(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SecureAggregationConfig(**options)


def test_layout_round_trips_and_is_ordered_by_record_then_key() -> None:
    layout = payload_layout({"b": {"y": (2, 3), "x": (1,)}, "a": {"z": ()}})
    assert [(r, k) for r, k, _ in layout] == [("a", "z"), ("b", "x"), ("b", "y")]
    assert decode_layout(encode_layout(layout)) == layout


# ------------------------------------------------------------------ rounds: secure vs plain


def make_grid(
    secure: bool, wrap: Callable | None = None, count: int = 5
) -> tuple[InProcessGrid, list[Produced]]:
    produced: list[Produced] = []
    mods = [secure_aggregation_mod] if secure else []
    app = least_squares_app(heterogeneous_problems(count), 0.05, ALPHAS, produced, mods)
    nodes = [app if wrap is None else wrap(app, k) for k in range(count)]
    return InProcessGrid(nodes, raise_errors=wrap is None), produced


def make_strategy(
    name: str, secure: SecureAggregationConfig | None, **sampling: float | int
) -> ProtocolStrategy:
    options = {"local_steps": 3, "min_available_nodes": 5, "secure_aggregation": secure}
    options |= sampling
    return {
        "fedavg": lambda: FedAvg(**options),
        "fedprox": lambda: FedProx(proximal_mu=0.1, **options),
        "scaffold": lambda: Scaffold(**options),
        "fedacg": lambda: FedACG(**options),
        "decentnerf": lambda: DecentNeRF(alpha_lr=0.2, **options),
        "fedavgm": lambda: FedAvgM(server_learning_rate=0.8, server_momentum=0.9, **options),
        "fedadam": lambda: FedAdam(**options),
        "fedyogi": lambda: FedYogi(**options),
        "fedadagrad": lambda: FedAdagrad(**options),
    }[name]()


def run_rounds(strategy: ProtocolStrategy, grid: InProcessGrid, rounds: int) -> dict[str, Tensor]:
    result = strategy.start(grid, state_to_arrays(initial_state()), num_rounds=rounds)
    return arrays_to_state(result.arrays)


def relative_error(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    difference = torch.cat([(a[k].double() - b[k].double()).flatten() for k in a])
    reference = torch.cat([b[k].double().flatten() for k in a])
    return float(difference.norm() / reference.norm())


def trained_nodes(grid: InProcessGrid) -> list[tuple[str, int]]:
    """(round, node) of every train message that carried the global model, in order."""
    return [
        (message.metadata.group_id, message.metadata.dst_node_id)
        for message in grid.sent
        if message.metadata.message_type == "train" and ARRAYS in message.content
    ]


SECURE_STRATEGIES = [
    "fedavg",
    "fedprox",
    "scaffold",
    "fedacg",
    "decentnerf",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "fedadagrad",
]
"""Every strategy that supports secure aggregation (FedNova and FedExP refuse it)."""
SECURE_TOLERANCE = 1e-5
"""Relative error allowed between a secure and a plaintext run: SecAgg+ quantises each value
to 2 / Q of its tensor's power-of-two scale, Q = (2^32 - 1) // n, ~1e-9 relative per value
for these 3 clients, far below this over 4 rounds (the benchmark measured <= 3.2e-8)."""


@pytest.mark.parametrize("name", SECURE_STRATEGIES)
def test_secure_rounds_equal_plaintext_rounds(name: str) -> None:
    """Same seeds, 3 of 5 nodes sampled a round: the secure run trains the same nodes and
    ends with the same global model (SecAgg+'s workflow shuffles with Python's global
    `random`, so the strategies sample with their own seeded RNG)."""
    sampling = {"fraction_train": 0.6, "min_train_nodes": 3, "sampling_seed": 11}
    plain_grid, plain_produced = make_grid(secure=False)
    plain = run_rounds(make_strategy(name, None, **sampling), plain_grid, rounds=4)
    secure_grid, secure_produced = make_grid(secure=True)
    strategy = make_strategy(name, SECURE, **sampling)
    secure = run_rounds(strategy, secure_grid, rounds=4)
    assert trained_nodes(secure_grid) == trained_nodes(plain_grid)
    assert len(set(trained_nodes(plain_grid))) == 12  # 3 a round
    assert len({node for _, node in trained_nodes(plain_grid)}) == 5  # sampling varied
    assert relative_error(secure, plain) < SECURE_TOLERANCE
    if name == "decentnerf":  # the alphas learned from the securely summed gradients agree
        plain_alphas = [p.alpha for p in sorted(plain_produced, key=by_round_and_node)]
        secure_alphas = [p.alpha for p in sorted(secure_produced, key=by_round_and_node)]
        assert np.allclose(secure_alphas, plain_alphas, rtol=1e-5)
        assert len(set(plain_alphas)) > len(ALPHAS)  # the alphas did move
    if name == "scaffold":
        assert all(c.abs().sum() > 0 for c in strategy.method.server_control.values())


def test_a_secure_run_is_the_same_whatever_numpys_global_state() -> None:
    """Flower's quantiser rounds each float at random with numpy's global generator; the mod
    seeds it for each SecAgg+ stage from the node's rounding seed and puts it back, so one
    seed gives one secure run, bit for bit."""
    sampling = {"fraction_train": 0.6, "min_train_nodes": 3, "sampling_seed": 11}
    results = []
    for outside in (1, 2):
        np.random.seed(outside)
        grid, _ = make_grid(secure=True)
        results.append(run_rounds(make_strategy("fedavg", SECURE, **sampling), grid, rounds=2))
    assert all(torch.equal(results[0][key], results[1][key]) for key in results[0])


def test_sampling_ignores_the_global_random_state() -> None:
    """A strategy's node sample depends on its seed only, not on who else draws from
    Python's global `random` (SecAgg+'s workflow does)."""
    grid, _ = make_grid(secure=False)
    samples = []
    for disturb in (False, True):
        strategy = make_strategy("fedavg", None, fraction_train=0.4, sampling_seed=3)
        if disturb:
            random.random()
        opened = strategy.begin_round(1, state_to_arrays(initial_state()), grid)
        samples.append(opened.ledger.node_ids)
    assert samples[0] == samples[1]


def by_round_and_node(produced: Produced) -> tuple[int, int]:
    return produced.server_round, produced.node_id


def numbers_received(messages: Sequence[Message]) -> np.ndarray:
    """Every number in the server's received messages: arrays, scalars, encoded arrays."""
    found: list[np.ndarray] = []
    for message in messages:
        for record in message.content.array_records.values():
            found += [array.numpy().astype(np.float64).ravel() for array in record.values()]
        records = [*message.content.config_records.values()]
        records += [*message.content.metric_records.values()]
        for record in records:
            for value in record.values():
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, bytes):
                        try:
                            found.append(bytes_to_ndarray(item).astype(np.float64).ravel())
                        except (ValueError, TypeError, OSError):
                            continue
                    elif isinstance(item, int | float) and not isinstance(item, bool):
                        found.append(np.array([float(item)]))
    return np.concatenate(found) if found else np.zeros(0)


def leaked(secrets: np.ndarray, received: np.ndarray) -> int:
    """How many secret values appear among the received numbers (relative 1e-9)."""
    received = np.sort(received)
    hits = 0
    for value in secrets:
        index = np.searchsorted(received, value)
        near = received[max(index - 1, 0) : index + 1]
        hits += bool(np.any(np.isclose(near, value, rtol=1e-9, atol=0)))
    return hits


def decentnerf_secrets(grid: InProcessGrid, produced: Sequence[Produced]) -> np.ndarray:
    """What DecentNeRF clients computed: alpha_k, g_k, alpha_k g_k and G_k."""
    problems = heterogeneous_problems(5)
    values: list[np.ndarray] = []
    for p in produced:
        local = torch.cat([p.local_state["weight"], p.local_state["bias"]]).numpy()
        values += [np.array([p.alpha]), local, p.alpha * local]
    for message in grid.sent:
        if message.metadata.message_type == GRADIENT_QUERY:
            partition = grid.contexts[message.metadata.dst_node_id].node_config["partition-id"]
            g = arrays_to_state(message.content[ARRAYS])
            gradient = problems[int(partition)].gradient(g)
            values.append(torch.cat([gradient["weight"], gradient["bias"]]).numpy())
    secrets = np.concatenate(values)
    return secrets[np.abs(secrets) > 1e-6]


def test_the_server_never_receives_a_decentnerf_clients_gradient_weights_or_alpha() -> None:
    plain_grid, plain_produced = make_grid(secure=False)
    run_rounds(make_strategy("decentnerf", None), plain_grid, rounds=2)
    plain_secrets = decentnerf_secrets(plain_grid, plain_produced)
    # the search finds them when they travel in plaintext
    assert leaked(plain_secrets, numbers_received(plain_grid.received)) > len(plain_secrets) // 2

    grid, produced = make_grid(secure=True)
    run_rounds(make_strategy("decentnerf", SECURE), grid, rounds=2)
    secrets = decentnerf_secrets(grid, produced)
    assert len(secrets) > 50 and len({p.server_round for p in produced}) == 2
    assert leaked(secrets, numbers_received(grid.received)) == 0
    secagg_replies = [m for m in grid.received if "fitres.num_examples" in m.content]
    # round 1 sums the payload, round 2 the gradients and the payload: 2 SecAgg+ runs each
    # (bounds, then values), 5 masked-vector replies per run
    assert len(secagg_replies) == 5 * 2 * 3
    for reply in secagg_replies:
        assert reply.content["fitres.num_examples"]["num_examples"] == 1.0
        assert len(reply.content["fitres.metrics"]) == 0
        assert not reply.content["fitres.parameters"]  # the mod sends masked bytes only


# ------------------------------------------------------------------ dropouts


def dropping_after_key_sharing(dropped: set[int]) -> Callable:
    """Node wrapper: partitions in `dropped` fail the payload's masked-vector stage."""

    def wrap(app: Callable, partition: int) -> Callable:
        def node(message: Message, context: Context) -> Message:
            config = message.content.config_records.get(RECORD_KEY_CONFIGS)
            fit_config = message.content.config_records.get("fitins.config")
            if (
                partition in dropped
                and config is not None
                and config.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
                and fit_config is not None
                and fit_config["secure-sum-stage"] == "payload"
            ):
                raise ConnectionError(f"partition {partition} went offline")
            return app(message, context)

        return node

    return wrap


def survivors_mean(dropped: set[int]) -> dict[str, Tensor]:
    """FedAvg of one round over the clients that did not drop, in plaintext."""
    problems = heterogeneous_problems(5)
    grid, _ = make_grid(secure=False)
    strategy = make_strategy("fedavg", None)
    messages = list(
        strategy.configure_train(1, state_to_arrays(initial_state()), ConfigRecord(), grid)
    )
    replies = [
        reply
        for reply in grid.send_and_receive(messages)
        if grid.contexts[reply.metadata.src_node_id].node_config["partition-id"] not in dropped
    ]
    assert len(replies) == len(problems) - len(dropped)
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays_to_state(arrays)


def test_dropouts_after_key_sharing_up_to_the_threshold_sum_the_survivors() -> None:
    dropped = {1, 3}
    config = SecureAggregationConfig(num_shares=1.0, reconstruction_threshold=3)
    grid, _ = make_grid(secure=True, wrap=dropping_after_key_sharing(dropped))
    strategy = make_strategy("fedavg", config)
    messages = strategy.configure_train(1, state_to_arrays(initial_state()), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is not None and metrics[SECURE_SUMS] == 1 and metrics[SECURE_FAILURES] == 0
    assert relative_error(arrays_to_state(arrays), survivors_mean(dropped)) < 1e-5


def test_dropouts_beyond_the_threshold_fail_the_round_and_keep_the_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = SecureAggregationConfig(num_shares=1.0, reconstruction_threshold=3)
    grid, _ = make_grid(secure=True, wrap=dropping_after_key_sharing({0, 2, 4}))
    strategy = make_strategy("fedavg", config)
    start = initial_state()
    start["bias"] += 0.25
    held: dict[int, dict[str, Tensor]] = {}

    def record_global(server_round: int, arrays: ArrayRecord) -> None:
        held[server_round] = arrays_to_state(arrays)

    def record_outcome(outcome: RoundOutcome, arrays: ArrayRecord) -> None:
        outcomes.append(outcome)

    outcomes: list[RoundOutcome] = []
    with pytest.raises(EmptyRoundsError, match="the secure sums failed"):  # nothing trained
        strategy.start(
            grid,
            state_to_arrays(start),
            num_rounds=1,
            evaluate_fn=record_global,
            round_end_fn=record_outcome,
        )
    assert sorted(held) == [0, 1]
    assert all(torch.equal(held[1][key], start[key]) for key in start)
    assert [outcome.metrics[SECURE_FAILURES] for outcome in outcomes] == [1]
    assert "SecAgg+ payload stage over 5 clients halted" in caplog.text
    assert "went offline" in caplog.text


def test_clients_refuse_values_beyond_a_fixed_clipping_range(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid, _ = make_grid(secure=True, wrap=lambda app, _: app)
    strategy = make_strategy("fedavg", SecureAggregationConfig(clipping_range=1e-3))
    messages = strategy.configure_train(1, state_to_arrays(initial_state()), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is None and metrics[SECURE_FAILURES] == 1
    assert "beyond the SecAgg+ clipping range 0.001" in caplog.text


def test_decentnerf_alpha_travels_only_inside_the_masked_payload() -> None:
    grid, produced = make_grid(secure=True)
    strategy = make_strategy("decentnerf", SECURE)
    messages = strategy.configure_train(1, state_to_arrays(initial_state()), ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages))
    assert all(set(reply.content.keys()) == {"held"} for reply in replies)
    payload = {"weight": (3,), "bias": (1,), ALPHA_KEY: (1,)}
    summed = strategy.round_of(1).sum(replies, {ARRAYS: payload})
    payload_sum = summed.sums[ARRAYS]
    assert math.isclose(float(payload_sum[ALPHA_KEY]), sum(p.alpha for p in produced), rel_tol=1e-6)
    assert isinstance(
        [m for m in grid.received if "held" in m.content][0].content["held"], ConfigRecord
    )
    assert not any(isinstance(r, ArrayRecord) for m in replies for r in m.content.values())
