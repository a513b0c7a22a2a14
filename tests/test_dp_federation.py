"""Client-level DP wired into the strategies, on in-process grids (and one `flwr` simulation).

Central DP (plaintext): each reply's update is clipped to C and the server adds N(0, (z C)^2)
to the sum; Flower's DifferentialPrivacyServerSideFixedClipping is the oracle on a FedAvg
round. Distributed DP (SecAgg+): each client clips and adds N(0, z^2 C^2 / n) before masking.
Noise std is measured over tens of thousands of entries against z C; the accountant's epsilon
against dp-accounting's own composition; a target epsilon stops the run before it is exceeded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from dp_reference import headline_epsilons
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from test_secure_aggregation import (
    SECURE_STRATEGIES,
    dropping_after_key_sharing,
    make_grid,
    make_strategy,
    relative_error,
)
from test_strategies import (
    fixed_reply_node,
    heterogeneous_problems,
    initial_state,
    least_squares_app,
)
from torch import Tensor

from fedfields.flower import (
    DecentNeRF,
    FedACG,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedExP,
    FedNova,
    FedProx,
    FedYogi,
    ProtocolStrategy,
    Scaffold,
)
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    GRADIENT,
    NUM_DROPPED,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_REPLIES,
    SECURE_SUM_LAYOUT,
    SECURE_SUM_STAGE,
    TRAIN_LOSS,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.resume import (
    ResumeError,
    RoundCheckpoint,
    load_round_checkpoint,
    save_round_checkpoint,
)
from fedfields.flower.round import DP_EPSILON, DP_ROUND_MULTIPLIER
from fedfields.flower.secure_aggregation import (
    CALIBRATED_STATE,
    check_threshold,
    private_records,
    secure_aggregation_mod,
)
from fedfields.methods import alpha_weighted_payload
from fedfields.methods.scaffold import CONTROL_DELTA
from fedfields.privacy.accountant import RoundCharge, epsilon_of
from fedfields.privacy.dp import DPConfig, distributed_noise_std, noise_generator, update_norm
from fedfields.privacy.secagg_plan import SecureAggregationConfig, ValueFreeError
from simulations.in_process_grid import InProcessGrid

ROOT = Path(__file__).resolve().parents[1]
State = dict[str, Tensor]
F64 = torch.float64
SIZE = 40_000
"""Entries of the big test model: the noise std is estimated to ~0.4% (1 / sqrt(2 SIZE))."""
STD_TOLERANCE = 0.02


def big_state(seed: int, scale: float = 1.0) -> State:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(SIZE - 100, generator=generator, dtype=F64) * scale,
        "b": torch.randn(100, generator=generator, dtype=F64) * scale,
    }


def plus(a: State, b: State, factor: float = 1.0) -> State:
    return {key: a[key] + factor * b[key] for key in a}


def clipped(update: State, clip_norm: float) -> State:
    """The update scaled to norm clip_norm (the tests' updates are all longer than C)."""
    norm = math.sqrt(sum(float(v.square().sum()) for v in update.values()))
    assert norm > clip_norm
    return {key: value * (clip_norm / norm) for key, value in update.items()}


def flat(state: State) -> Tensor:
    return torch.cat([state[key].double().flatten() for key in sorted(state)])


def fixed_nodes(reference: State, updates: list[State], weights: list[float]) -> list[Callable]:
    return [
        fixed_reply_node({ARRAYS: plus(reference, u)}, {NUM_EXAMPLES: w, TRAIN_LOSS: 1.0})
        for u, w in zip(updates, weights, strict=True)
    ]


def secure(node: Callable) -> Callable:
    def held(message: Message, context: Context) -> Message:
        return secure_aggregation_mod(message, context, node)

    return held


def train_round(
    strategy: ProtocolStrategy, grid: InProcessGrid, arrays: ArrayRecord, server_round: int = 1
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
    return strategy.aggregate_train(server_round, list(grid.send_and_receive(messages)))


# ------------------------------------------------------------------ central DP


def test_a_central_dp_fedavg_round_is_flowers_fixed_clipping_with_uniform_weights() -> None:
    """Clipped mean as Flower's DifferentialPrivacyServerSideFixedClipping computes it (no
    noise there, negligible noise here); our replies' unequal num-examples do not weigh."""
    reference = {key: value.float() for key, value in big_state(0).items()}
    updates = [
        {k: v.float() for k, v in big_state(seed, scale).items()}
        for seed, scale in ((1, 1e-4), (2, 0.02), (3, 3.0))
    ]
    ours = FedAvg(min_available_nodes=3, differential_privacy=DPConfig(1e-9, 1.5))
    grid = InProcessGrid(fixed_nodes(reference, updates, [5, 500, 50]))
    arrays, metrics = train_round(ours, grid, state_to_arrays(reference))
    flower = DifferentialPrivacyServerSideFixedClipping(
        FlowerFedAvg(min_available_nodes=3), noise_multiplier=0.0, clipping_norm=1.5,
        num_sampled_clients=3,
    )  # fmt: skip
    flower_grid = InProcessGrid(fixed_nodes(reference, updates, [5, 5, 5]))
    messages = flower.configure_train(1, state_to_arrays(reference), ConfigRecord(), flower_grid)
    oracle, _ = flower.aggregate_train(1, list(flower_grid.send_and_receive(messages)))
    assert arrays is not None and oracle is not None and metrics is not None
    ours_state, oracle_state = arrays_to_state(arrays), arrays_to_state(oracle)
    assert ours_state["w"].dtype == torch.float32
    torch.testing.assert_close(ours_state, oracle_state, rtol=0, atol=2e-6)
    assert metrics[DP_ROUND_MULTIPLIER] == 1e-9 and metrics[DP_EPSILON] > 1e6


def test_central_noise_has_std_z_c_on_the_sum_like_flowers_on_the_mean() -> None:
    """4 clients, updates 10x the clip norm: (aggregate - clipped mean) x 4 is the noise on
    the sum, std z C; Flower's wrapper adds z C / 4 to the mean (its compute_stdv)."""
    z, clip_norm, n = 1.3, 0.25, 4
    reference = big_state(0)
    updates = [big_state(seed, 10 * clip_norm / math.sqrt(SIZE)) for seed in range(1, n + 1)]
    expected = plus(reference, {k: sum(clipped(u, clip_norm)[k] for u in updates) / n
                                for k in reference})  # fmt: skip
    dp = DPConfig(z, clip_norm, max_noise_ratio=0)  # the noise is what is measured
    ours = FedAvg(min_available_nodes=n, differential_privacy=dp)
    arrays, _ = train_round(ours, InProcessGrid(fixed_nodes(reference, updates, [1] * n)),
                            state_to_arrays(reference))  # fmt: skip
    noise_on_sum = flat(plus(arrays_to_state(arrays), expected, -1.0)) * n
    flower = DifferentialPrivacyServerSideFixedClipping(
        FlowerFedAvg(min_available_nodes=n), noise_multiplier=z, clipping_norm=clip_norm,
        num_sampled_clients=n,
    )  # fmt: skip
    flower_grid = InProcessGrid(fixed_nodes(reference, updates, [1] * n))
    messages = flower.configure_train(1, state_to_arrays(reference), ConfigRecord(), flower_grid)
    oracle, _ = flower.aggregate_train(1, list(flower_grid.send_and_receive(messages)))
    flower_noise_on_mean = flat(plus(arrays_to_state(oracle), expected, -1.0))
    ours_ratio = float(noise_on_sum.std()) / (z * clip_norm)
    flower_ratio = float(flower_noise_on_mean.std()) * n / (z * clip_norm)
    print(f"central noise std / (z C): ours {ours_ratio:.4f}, Flower's x n {flower_ratio:.4f}")
    assert abs(ours_ratio - 1) < STD_TOLERANCE and abs(flower_ratio - 1) < STD_TOLERANCE
    assert abs(float(noise_on_sum.mean())) < 5 * z * clip_norm / math.sqrt(SIZE)


def test_central_noise_is_secret_unless_a_test_injects_a_generator() -> None:
    """Same sampling seed, same replies: the noise differs (never seeded from run-config);
    an injected seeded generator replays it."""
    reference, update = big_state(0), big_state(1, 0.1)

    def aggregate(generator: torch.Generator | None) -> Tensor:
        strategy = FedAvg(
            min_available_nodes=2,
            sampling_seed=3,
            differential_privacy=DPConfig(1.0, 0.5, max_noise_ratio=0),
        )
        assert strategy.privacy is not None
        strategy.privacy.noise = generator
        grid = InProcessGrid(fixed_nodes(reference, [update, update], [1, 1]))
        arrays, _ = train_round(strategy, grid, state_to_arrays(reference))
        return flat(arrays_to_state(arrays))

    assert not torch.equal(aggregate(None), aggregate(None))
    assert torch.equal(aggregate(noise_generator(7)), aggregate(noise_generator(7)))


HOSTILE = {
    "huge float64": ({"w": torch.full((50,), 1e200, dtype=F64)}, None),
    "float16 beyond its range": ({"w": torch.full((50,), 6e4, dtype=torch.float16)}, None),
    "negative and large": ({"w": -torch.arange(50, dtype=F64) * 1e6}, None),
    "tiny (kept as is)": ({"w": torch.full((50,), 1e-3, dtype=F64)}, None),
    "zero": ({"w": torch.zeros(50, dtype=F64)}, None),
    "NaN (dropped by the gate)": ({"w": torch.full((50,), math.nan, dtype=F64)}, "non-finite"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_clipping_never_lets_one_clients_contribution_exceed_c(name: str) -> None:
    """One client per round, noise negligible, no update-norm cap: the global model moves
    by at most C (up to rounding into the model's dtype, post-processing) whatever the client
    sends; a NaN reply is dropped and counted."""
    state, dropped = HOSTILE[name]
    clip_norm = 0.75
    reference = {"w": torch.zeros(50, dtype=state["w"].dtype)}
    strategy = FedAvg(
        min_available_nodes=1, min_train_nodes=1, max_update_norm=None,
        differential_privacy=DPConfig(1e-12, clip_norm),
    )  # fmt: skip
    node = fixed_reply_node({ARRAYS: state}, {NUM_EXAMPLES: 1.0})
    arrays, metrics = train_round(strategy, InProcessGrid([node]), state_to_arrays(reference))
    assert metrics is not None
    if dropped:
        assert arrays is None and metrics[NUM_DROPPED] == 1 and metrics[f"dropped-{dropped}"] == 1
        assert DP_ROUND_MULTIPLIER not in metrics  # nothing released, nothing charged
        return
    moved = update_norm({"w": arrays_to_state(arrays)["w"].double()})
    roundoff = max(1e-9, float(torch.finfo(state["w"].dtype).eps))  # the model's own dtype
    assert moved <= clip_norm * (1 + roundoff)
    if name.startswith("tiny"):
        assert moved == pytest.approx(update_norm(state), rel=1e-9)


def test_scaffold_clips_the_model_and_control_deltas_jointly() -> None:
    """||(x+ - x, c+ - c)|| <= C for one client whose y and delta c are both huge."""
    clip_norm = 0.5
    x = {"w": torch.zeros(20, dtype=F64)}
    node = fixed_reply_node(
        {ARRAYS: {"w": torch.full((20,), 1e6, dtype=F64)},
         CONTROL_DELTA: {"w": torch.full((20,), -3e5, dtype=F64)}},
        {NUM_EXAMPLES: 1.0},
    )  # fmt: skip
    strategy = Scaffold(
        min_available_nodes=1, min_train_nodes=1, max_update_norm=None, max_control_norm=None,
        differential_privacy=DPConfig(1e-12, clip_norm),
    )  # fmt: skip
    arrays, _ = train_round(strategy, InProcessGrid([node]), state_to_arrays(x))
    moved = torch.cat([arrays_to_state(arrays)["w"], strategy.method.server_control["w"]])
    assert float(moved.norm()) <= clip_norm * (1 + 1e-9)
    assert float(arrays_to_state(arrays)["w"].norm()) > 0.4 * clip_norm  # both parts kept


def test_decentnerf_clips_alpha_times_update_and_alpha_jointly() -> None:
    """One user with alpha = alpha-max and a huge g_k: the summed (alpha (g_k - g), alpha) has
    norm <= C (clipping rescales the user's weight, so the aggregate is still g_k)."""
    clip_norm, alpha = 0.5, 100.0
    g = {"w": torch.ones(20, dtype=F64)}
    g_k = {"w": torch.full((20,), 1e4, dtype=F64)}
    node = fixed_reply_node({ARRAYS: alpha_weighted_payload(g_k, alpha)}, {NUM_EXAMPLES: 1.0})
    strategy = DecentNeRF(
        min_available_nodes=1, min_train_nodes=1, max_update_norm=None,
        differential_privacy=DPConfig(1e-12, clip_norm),
    )  # fmt: skip
    arrays, _ = train_round(strategy, InProcessGrid([node]), state_to_arrays(g))
    assert strategy.method.last_aggregate is not None
    alpha_sum = strategy.method.last_aggregate[1]
    update = arrays_to_state(arrays)["w"] - g["w"]
    assert alpha_sum * math.sqrt(float(update.square().sum()) + 1) <= clip_norm * (1 + 1e-9)
    torch.testing.assert_close(arrays_to_state(arrays), g_k, rtol=1e-6, atol=0)


def test_decentnerf_charges_both_noised_sums_of_a_round() -> None:
    """From round 2 the gradient query's sum and the payload's are noised: the round is
    charged z / sqrt(2) (one Gaussian query of sensitivity C sqrt(2))."""
    problems = heterogeneous_problems(3)
    app = least_squares_app(problems, 0.05, (0.5, 1.0, 1.5))
    strategy = DecentNeRF(  # alphas frozen: the test app does not clamp them
        min_available_nodes=3, local_steps=2, alpha_lr=0.0,
        differential_privacy=DPConfig(0.3, 2.0),
    )  # fmt: skip
    assert strategy.privacy is not None
    strategy.privacy.noise = noise_generator(3)
    result = strategy.start(InProcessGrid([app] * 3), state_to_arrays(initial_state()), 3)
    multipliers = [result.train_metrics_clientapp[r][DP_ROUND_MULTIPLIER] for r in (1, 2, 3)]
    assert multipliers == pytest.approx([0.3, 0.3 / math.sqrt(2), 0.3 / math.sqrt(2)])
    assert strategy.rounds_aggregated == 3
    charges = [RoundCharge(1.0, z) for z in multipliers]
    assert result.train_metrics_clientapp[3][DP_EPSILON] == pytest.approx(
        epsilon_of(charges, 1e-5), rel=1e-12
    )


def test_an_unmasked_secure_sum_refused_afterwards_is_still_charged() -> None:
    """Secure DecentNeRF under DP with z = 5: the payload's noised alpha sum lies within 3
    noise stds of 0, so no aggregate is formed; the server saw that sum all the same, so the
    round is charged for its 3 holders at t = 2 (z sqrt(2/1), its one-fewer neighbour's)."""
    problems = heterogeneous_problems(3)
    app = secure(least_squares_app(problems, 0.05, (0.5, 1.0, 1.5)))
    strategy = DecentNeRF(
        min_available_nodes=3, local_steps=1, alpha_lr=0.0, differential_privacy=DPConfig(
            5.0, 1.0, max_noise_ratio=0), secure_aggregation=SecureAggregationConfig(),
    )  # fmt: skip
    arrays, metrics = train_round(
        strategy, InProcessGrid([app] * 3), state_to_arrays(initial_state())
    )
    assert arrays is None and strategy.round_of(1).ledger.unmasked_holders == [3]
    assert metrics is not None and metrics[DP_ROUND_MULTIPLIER] == pytest.approx(5 * math.sqrt(2))
    assert metrics[DP_EPSILON] == pytest.approx(
        epsilon_of([RoundCharge(1.0, 5 * math.sqrt(2))], 1e-5), rel=1e-12
    )


def test_decentnerfs_gradient_query_has_its_own_clip_norm() -> None:
    """dp-gradient-clip-norm C_G = 0.01 clips each G_k on its own: the G sent in round 2 is
    the sum of 3 clipped G_k (norm <= 3 C_G, noise negligible), where with the payload's C = 2
    (C_G = 0) the same G_k sum to a norm far above that."""

    def round_two_gradient_norm(gradient_clip_norm: float) -> float:
        problems = heterogeneous_problems(3)
        app = least_squares_app(problems, 0.05, (0.5, 1.0, 1.5))
        dp = DPConfig(1e-9, 2.0, gradient_clip_norm=gradient_clip_norm, max_noise_ratio=0)
        strategy = DecentNeRF(min_available_nodes=3, local_steps=2, alpha_lr=0.0,
                              differential_privacy=dp)  # fmt: skip
        grid = InProcessGrid([app] * 3)
        strategy.start(grid, state_to_arrays(initial_state()), 2)
        sent = [m for m in grid.sent if "gradient" in m.content.array_records]
        assert sent, "round 2 sent no G"
        return float(flat(arrays_to_state(sent[0].content["gradient"])).norm())

    assert round_two_gradient_norm(0.01) <= 0.03 * (1 + 1e-6)
    assert round_two_gradient_norm(0.0) > 10 * 0.03


@pytest.mark.parametrize("kind", [FedNova, FedExP])
def test_rules_reading_per_client_values_refuse_dp_naming_themselves(kind: type) -> None:
    with pytest.raises(ValueError, match=f"{kind.strategy_name} does not support client-level DP"):
        kind(differential_privacy=DPConfig(1.0, 1.0))
    with pytest.raises(ValueError, match="'median' is not a sum of clipped updates"):
        FedAvg(aggregation_rule="median", differential_privacy=DPConfig(1.0, 1.0))


# ------------------------------------------------------------------ distributed DP


def test_a_clients_private_records_are_clipped_jointly_then_noised() -> None:
    """The client's side of distributed DP: hostile records clipped to C jointly, plus its
    noise share of std z C / sqrt(n) (measured over 40k entries)."""
    config = ConfigRecord({"dp-clip-norm": 0.5, "dp-noise-multiplier": 1e-12, "dp-min-holders": 4})
    records = {ARRAYS: {"w": torch.full((30,), 1e150, dtype=F64)},
               CONTROL_DELTA: {"w": torch.full((30,), -1e150, dtype=F64)}}  # fmt: skip
    out = private_records(records, config, noise_generator(1))[0]
    assert float(torch.cat([out[ARRAYS]["w"], out[CONTROL_DELTA]["w"]]).norm()) <= 0.5 + 1e-9
    config = ConfigRecord({"dp-clip-norm": 0.5, "dp-noise-multiplier": 1.7, "dp-min-holders": 4})
    zero = {ARRAYS: {key: torch.zeros_like(v) for key, v in big_state(0).items()}}
    share = flat(private_records(zero, config, noise_generator(2))[0][ARRAYS])
    ratio = float(share.std()) / distributed_noise_std(1.7, 0.5, 4)
    print(f"one client's noise share std / (z C / sqrt(n)): {ratio:.4f}")
    assert abs(ratio - 1) < STD_TOLERANCE


@pytest.mark.parametrize("dropped", [set(), {2}])
def test_distributed_noise_sums_to_z_c_and_dropouts_are_charged(dropped: set[int]) -> None:
    """4 secure clients, updates 10x C, reconstruction threshold t = 3: each noise share is
    calibrated so that t - 1 = 2 of them carry z C: the secure aggregate minus the survivors'
    clipped mean, times the survivors, is the summed noise of std z C sqrt(h / 2) for h = 4
    survivors (or 3 when one drops after key sharing); the accountant is charged the
    multiplier of one holder fewer, z sqrt((h - 1) / 2)."""
    z, clip_norm, n = 1.0, 0.5, 4
    reference = big_state(0)
    updates = [big_state(seed, 10 * clip_norm / math.sqrt(SIZE)) for seed in range(1, n + 1)]
    nodes = [secure(node) for node in fixed_nodes(reference, updates, [1, 7, 1, 3])]
    wrap = dropping_after_key_sharing(dropped)
    grid = InProcessGrid([wrap(node, k) for k, node in enumerate(nodes)])
    strategy = FedAvg(
        min_available_nodes=n, differential_privacy=DPConfig(z, clip_norm, max_noise_ratio=0),
        secure_aggregation=SecureAggregationConfig(reconstruction_threshold=3),
    )  # fmt: skip
    arrays, metrics = train_round(strategy, grid, state_to_arrays(reference))
    assert arrays is not None and metrics is not None
    survivors = [u for k, u in enumerate(updates) if k not in dropped]
    kept = len(survivors)
    expected = plus(reference, {k: sum(clipped(u, clip_norm)[k] for u in survivors) / kept
                                for k in reference})  # fmt: skip
    noise_on_sum = flat(plus(arrays_to_state(arrays), expected, -1.0)) * kept
    carried = z * math.sqrt(kept / 2)
    ratio = float(noise_on_sum.std()) / (carried * clip_norm)
    print(f"distributed noise std / (z sqrt(h / (t - 1)) C), {len(dropped)} dropped: {ratio:.4f}")
    assert abs(ratio - 1) < STD_TOLERANCE
    charged = z * math.sqrt((kept - 1) / 2)
    assert metrics[DP_ROUND_MULTIPLIER] == pytest.approx(charged)
    assert metrics[DP_EPSILON] == pytest.approx(
        epsilon_of([RoundCharge(1.0, charged)], 1e-5), rel=1e-12
    )
    sent = [m for m in grid.sent if m.metadata.message_type == "train" and CONFIG in m.content]
    assert all("secure-weight" not in m.content[CONFIG] for m in sent)  # uniform weights
    assert all(m.content[CONFIG]["dp-min-holders"] == 3 for m in sent)
    assert secure_stages(grid) and "bounds" not in secure_stages(grid)  # range from C, z, t


def secure_stages(grid: InProcessGrid) -> set[str]:
    """The fedfields secure-sum stages the server's SecAgg+ messages asked for."""
    return {
        str(m.content.config_records["fitins.config"][SECURE_SUM_STAGE])
        for m in grid.sent
        if "fitins.config" in m.content.config_records
        and SECURE_SUM_STAGE in m.content.config_records["fitins.config"]
    }


def test_without_dp_a_secure_sum_first_asks_for_bounds() -> None:
    """The contrast: a plaintext-weighted secure round (no DP) plans its range from a bounds
    stage, so the assertion above that DP runs none can fail."""
    reference = big_state(0)
    updates = [big_state(seed, 0.01) for seed in range(1, 5)]
    grid = InProcessGrid([secure(node) for node in fixed_nodes(reference, updates, [1] * 4)])
    strategy = FedAvg(
        min_available_nodes=4,
        secure_aggregation=SecureAggregationConfig(reconstruction_threshold=3),
    )
    arrays, _ = train_round(strategy, grid, state_to_arrays(reference))
    assert arrays is not None and "bounds" in secure_stages(grid)


def dropping_first(count: int) -> Callable:
    """Node wrapper: the first `count` nodes to reach the payload's masked-vector stage fail it
    (after key sharing, so their masks must be recovered from the others' shares)."""
    failed: list[int] = []

    def wrap(app: Callable, partition: int) -> Callable:
        def node(message: Message, context: Context) -> Message:
            config = message.content.config_records.get(RECORD_KEY_CONFIGS)
            if config is not None and config.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS:
                if len(failed) < count or partition in failed:
                    failed.append(partition)
                    raise ConnectionError(f"partition {partition} went offline")
            return app(message, context)

        return node

    return wrap


@pytest.mark.parametrize(("dropped", "holders"), [(0, 20), (7, 13), (8, None), (12, None)])
def test_secure_dp_never_exceeds_its_target_whatever_drops(
    dropped: int, holders: int | None
) -> None:
    """20 of 40 sampled, z = 1, dp-target-epsilon = one round's epsilon at z = 1: the round
    fixes t = 13 (SecAgg+'s threshold of 20) and sends it to the clients, whose noise shares
    sum to z C over any 12. Down to 13 holders the sum is released and charged
    z sqrt((h - 1) / 12) >= z; with 12 or fewer it is never unmasked, nothing is released or
    charged. Epsilon never exceeds the target (the old plan let 9 of 20 through at
    z sqrt(9 / 20): 6.61 > 6)."""
    z, clip_norm, population, size = 1.0, 1.0, 40, 64
    target = epsilon_of([RoundCharge(0.5, z)], 1e-5) * (1 + 1e-9)
    generator = torch.Generator().manual_seed(3)
    reference = {"w": torch.zeros(size, dtype=F64)}
    updates = [{"w": torch.randn(size, generator=generator, dtype=F64)} for _ in range(population)]
    nodes = [secure(node) for node in fixed_nodes(reference, updates, [1.0] * population)]
    wrap = dropping_first(dropped)
    grid = InProcessGrid([wrap(node, k) for k, node in enumerate(nodes)])
    dp = DPConfig(z, clip_norm, target_epsilon=target, max_noise_ratio=0)
    strategy = FedAvg(
        fraction_train=0.5, min_available_nodes=population, differential_privacy=dp,
        secure_aggregation=SecureAggregationConfig(), sampling_seed=5,
    )  # fmt: skip
    arrays, metrics = train_round(strategy, grid, state_to_arrays(reference))
    sent = [m for m in grid.sent if m.metadata.message_type == "train" and CONFIG in m.content]
    assert len(sent) == 20 and all(m.content[CONFIG]["dp-min-holders"] == 13 for m in sent)
    assert strategy.round_of(1).ledger.unmasked_holders == ([] if holders is None else [holders])
    assert metrics is not None and metrics[DP_EPSILON] <= target
    if holders is None:
        assert arrays is None and metrics["secure-sum-failures"] == 1
        assert DP_ROUND_MULTIPLIER not in metrics and metrics[DP_EPSILON] == 0
    else:
        assert arrays is not None
        assert metrics[DP_ROUND_MULTIPLIER] == pytest.approx(z * math.sqrt((holders - 1) / 12))


def test_a_client_refuses_a_secagg_setup_below_its_calibration() -> None:
    """A client whose noise share was calibrated to t = 13 refuses a SecAgg+ setup asking for
    a reconstruction threshold of 12 (a sum of 12 shares would carry less than z C), by name
    and without values; 13 passes to Flower's mod."""
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    context.state[CALIBRATED_STATE] = ConfigRecord({"dp-min-holders": 13})

    def setup(threshold: int) -> Message:
        stage = ConfigRecord({Key.STAGE: Stage.SETUP, Key.THRESHOLD: threshold})
        return Message(RecordDict({RECORD_KEY_CONFIGS: stage}), dst_node_id=1, message_type="train")

    with pytest.raises(ValueFreeError, match="threshold of 12, below the dp-min-holders = 13"):
        check_threshold(setup(12), context)
    check_threshold(setup(13), context)


def dp_strategy(name: str, secure: SecureAggregationConfig | None) -> ProtocolStrategy:
    """3 of 5 nodes a round, updates clipped hard (C = 0.01), noise negligible."""
    options = {
        "local_steps": 3, "min_available_nodes": 5, "fraction_train": 0.6, "min_train_nodes": 3,
        "sampling_seed": 11, "secure_aggregation": secure,
        "differential_privacy": DPConfig(1e-9, 0.01),
    }  # fmt: skip
    return {
        "fedavg": lambda: FedAvg(**options),
        "fedprox": lambda: FedProx(proximal_mu=0.1, **options),
        "scaffold": lambda: Scaffold(**options),
        "fedacg": lambda: FedACG(**options),
        "decentnerf": lambda: DecentNeRF(alpha_lr=0.0, **options),
        "fedavgm": lambda: FedAvgM(server_learning_rate=0.8, server_momentum=0.9, **options),
        "fedadam": lambda: FedAdam(**options),
        "fedyogi": lambda: FedYogi(**options),
        "fedadagrad": lambda: FedAdagrad(**options),
    }[name]()


SERVER_OPTIMISERS = ("fedavgm", "fedadam", "fedyogi", "fedadagrad")
"""Their server step scales the clipped mean by its own rule: no bound of 3 rounds of C."""


@pytest.mark.parametrize("name", SECURE_STRATEGIES)
def test_distributed_dp_clips_as_central_dp_does(name: str) -> None:
    """With negligible noise, the clients' clipping under SecAgg+ (differences, DecentNeRF's
    alpha-scaled ones, restored to models on the server) gives the plaintext DP run's model,
    and the clip was active (the DP model differs from the unclipped one)."""
    start = state_to_arrays(initial_state())
    plain_grid, _ = make_grid(secure=False)
    plain = dp_strategy(name, None).start(plain_grid, start, num_rounds=3).arrays
    secure_grid, _ = make_grid(secure=True)
    secure = dp_strategy(name, SecureAggregationConfig()).start(secure_grid, start, 3).arrays
    assert relative_error(arrays_to_state(secure), arrays_to_state(plain)) < 1e-6
    unclipped_grid, _ = make_grid(secure=False)
    unclipped = make_strategy(name, None, fraction_train=0.6, min_train_nodes=3,
                              sampling_seed=11).start(unclipped_grid, start, 3).arrays  # fmt: skip
    assert relative_error(arrays_to_state(plain), arrays_to_state(unclipped)) > 1e-3
    if name != "decentnerf" and name not in SERVER_OPTIMISERS:  # DecentNeRF's clip
        # rescales the users' weights only
        moved = flat(arrays_to_state(plain)) - flat(initial_state())
        bound = 3 * 0.01 * (1 + 0.2 + 0.2**2)  # 3 rounds of <= C, FedACG's momentum lambda 0.2
        assert float(moved.norm()) <= bound
        assert float((flat(arrays_to_state(unclipped)) - flat(initial_state())).norm()) > bound


def test_a_fixed_secagg_clipping_range_must_leave_room_for_the_noise() -> None:
    dp = DPConfig(2.0, 1.0)
    with pytest.raises(ValueError, match="secagg-clipping-range = 3 leaves no room for the DP"):
        FedAvg(differential_privacy=dp, secure_aggregation=SecureAggregationConfig(
            clipping_range=3.0))  # fmt: skip
    FedAvg(differential_privacy=dp, secure_aggregation=SecureAggregationConfig(clipping_range=17))


# ------------------------------------------------------------------ budget and resume


def budget_run(target: float, rounds: int) -> tuple[FedAvg, InProcessGrid, dict]:
    """3 nodes, 2 sampled a round (q = 2/3) while the plan assumes fraction-train 0.34."""
    reference = {"w": torch.zeros(10, dtype=F64)}
    nodes = fixed_nodes(reference, [{"w": torch.ones(10, dtype=F64) * k} for k in (1, 2, 3)],
                        [1, 1, 1])  # fmt: skip
    grid = InProcessGrid(nodes)
    strategy = FedAvg(
        fraction_train=0.34, min_train_nodes=2, min_available_nodes=3, sampling_seed=0,
        differential_privacy=DPConfig(2.0, 1.0, 1e-5, target),
    )  # fmt: skip
    result = strategy.start(grid, state_to_arrays(reference), num_rounds=rounds)
    return strategy, grid, result.train_metrics_clientapp


def test_a_target_epsilon_stops_the_run_before_it_is_exceeded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """z = 2, 2 of 3 sampled a round while the plan assumes q = 0.34: the plan passes, and the
    run stops before the round that would take epsilon (k of n without replacement) above
    the target, having sent nothing of it."""
    two, three = (epsilon_of([RoundCharge(2 / 3, 2.0, 2, 3)] * r, 1e-5) for r in (2, 3))
    target = (two + three) / 2
    assert epsilon_of([RoundCharge(0.34, 2.0)] * 4, 1e-5) <= target  # the plan passes
    strategy, grid, metrics = budget_run(target, rounds=4)
    assert sorted(metrics) == [1, 2]
    assert metrics[2][DP_EPSILON] == pytest.approx(two, rel=1e-12) and two <= target
    assert strategy.privacy is not None and "round 3 not run" in strategy.privacy.stop
    assert "dp-target-epsilon reached" in caplog.text
    trained = {m.metadata.group_id for m in grid.sent if m.metadata.message_type == "train"}
    assert trained == {"1", "2"}  # nothing of round 3 was sent
    with pytest.raises(ValueError, match="'dp-target-epsilon' = 2 cannot be met: 50 rounds"):
        budget_run(2.0, rounds=50)


def test_the_accountant_survives_a_resume(tmp_path: Path) -> None:
    strategy, _, metrics = budget_run(100.0, rounds=2)
    checkpoint = RoundCheckpoint.capture(2, state_to_arrays({"w": torch.zeros(3)}), strategy)
    save_round_checkpoint(tmp_path / "resume.pt", checkpoint)
    resumed = FedAvg(differential_privacy=DPConfig(1.0, 1.0, 1e-5, 100.0))
    load_round_checkpoint(tmp_path / "resume.pt").restore(resumed)
    assert resumed.privacy is not None and strategy.privacy is not None
    assert resumed.privacy.accountant.charges == strategy.privacy.accountant.charges
    assert resumed.privacy.accountant.epsilon() == metrics[2][DP_EPSILON]
    without = RoundCheckpoint.capture(2, state_to_arrays({"w": torch.zeros(3)}), FedAvg())
    with pytest.raises(ValueError, match="no DP accountant"):
        without.restore(resumed)


# ------------------------------------------------------------------ the jobs


def test_a_secure_dp_run_through_the_launcher_completes_within_its_target_epsilon(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """The documented command as a user types it (`python -m simulations.launch`: `flwr run .`
    on Ray) with secure aggregation and distributed DP on the session's 3 users (all 3 a
    round: min-train-nodes 3, secure aggregation's floor, while the plan assumes fraction-train
    0.25), z = 2, C = 0.1, dp-target-epsilon 6 over 3 rounds. Each round fixes t = 2 (SecAgg+'s
    threshold of 3) and calibrates the noise shares so that t - 1 carry z C, so 3 holders are
    charged their one-fewer neighbour's z sqrt(2/1). The plan (3 rounds at q = 0.25: 5.25)
    passes; rounds 1-2 run; round 3's worst case (only t = 2 holders: z) would take epsilon to
    7.08, so the run stops cleanly after round 2, summary.json says why and the launcher exits
    0 (docs/PRIVACY.md). Each round's epsilon is Flower's RdpAccountant's for 3 of 3 sampled
    without replacement at z sqrt(2) / 2 (replace-one)."""
    charged = 2 * math.sqrt(2)
    flower = headline_epsilons(3, 3, charged, rounds=2)
    target = 6.0
    assert epsilon_of([RoundCharge(0.25, 2.0)] * 3, 1e-5) <= target  # the plan passes
    assert epsilon_of([RoundCharge(1.0, charged, 3, 3)] * 2 + [RoundCharge(1.0, 2.0, 3, 3)],
                      1e-5) > target  # fmt: skip
    run_config = (
        "strategy='fedavg' secure-aggregation=true dp-noise-multiplier=2.0 dp-clip-norm=0.1 "
        "fraction-train=0.25 "
        f"dp-target-epsilon={target} min-train-nodes=3 num-server-rounds=3 local-steps=1 "
        "orbit-frames=0 target-samples=1024 hash-log2-size=10 hash-levels=4 hash-max-resolution=64 "
        "client-eval-views=0 dp-max-noise-ratio=0"
    )
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "simulations.launch", "--no-audit", "--crowd", str(crowd_dir)]
    command += ["--run-dir", str(run_dir), "--run-config", run_config]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "dp-target-epsilon reached" in output, output[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2]  # nothing of round 3
    seen = [(line[DP_ROUND_MULTIPLIER], line[NUM_REPLIES], line["secure-sums"]) for line in lines]
    assert seen == [(pytest.approx(charged), 3, 1)] * 2, output[-3000:]
    assert [line[DP_EPSILON] for line in lines] == pytest.approx(flower[:2], rel=1e-9)
    summary = json.loads((run_dir / "summary.json").read_text())
    privacy = summary["differential-privacy"]
    assert privacy["form"].startswith("distributed") and privacy["rounds-charged"] == 2
    assert privacy["stopped"].startswith("round 3 not run: its charge (q = 1, z = 2)")
    assert "the run stops after round 2" in privacy["stopped"]
    assert summary["final"][DP_EPSILON] == pytest.approx(flower[1], rel=1e-9)
    assert summary["final"][DP_EPSILON] <= target
    assert "dp-epsilon" in (run_dir / "report.html").read_text()


def test_a_meta_job_reports_epsilon_and_a_resumed_run_continues_it(tmp_path: Path) -> None:
    """FedMeNF on faces, 2 of 4 clients a round (q = 1/2), central DP: metrics.jsonl and
    summary.json carry epsilon after each round; a resumed run continues the accountant
    (round 2 is epsilon after 2 rounds, not 1) under the same dp-target-epsilon."""
    from test_meta_job import run_in_process, tiny

    def epsilon(rounds: int) -> float:
        return epsilon_of([RoundCharge(0.5, 1.0, 2, 4)] * rounds, 1e-5)

    run_dir = tmp_path / "run"
    settings = {"simulation-audit": False, "dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0,
                "dp-target-epsilon": (epsilon(2) + epsilon(3)) / 2}  # fmt: skip
    run_in_process(tiny(run_dir, **{"num-server-rounds": 1}, **settings))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"][DP_EPSILON] == pytest.approx(epsilon(1), rel=1e-12)
    # beside it, as assumptions: Poisson sampling's figure and its PLD (tighter still)
    poisson = summary["final"]["dp-epsilon-poisson"]
    pld = summary["final"]["dp-epsilon-poisson-pld"]
    assert 0 < pld < poisson < epsilon(1)
    assert summary["differential-privacy"]["form"] == "central (server)"
    run_in_process(tiny(run_dir, resume=True, **settings))  # a restarted server and nodes
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line[DP_EPSILON] for line in lines] == pytest.approx([epsilon(1), epsilon(2)])


# ------------------------------------------------------------------ the node's own noise floor


@pytest.mark.parametrize(
    ("server_z", "secure_run", "refused"),
    [(0.5, True, True), (1.0, True, False), (2.0, True, False), (0.0, False, True)],
)
def test_a_node_refuses_less_noise_than_its_node_config_floor(
    server_z: float, secure_run: bool, refused: bool
) -> None:
    """node-config dp-min-noise-multiplier = 1 on one of 4 nodes: a secure DP round below
    z = 1, or a plaintext one, gets an error reply from it (counted, before it trains), the
    others still aggregate; at or above the floor it takes part."""
    from fedfields.flower.secure_aggregation import NOISE_FLOOR_KEY

    reference = big_state(0)
    updates = [big_state(seed, 0.01) for seed in range(1, 5)]
    nodes = fixed_nodes(reference, updates, [1] * 4)
    trained: list[int] = []

    def counting(node: Callable) -> Callable:
        def handler(message: Message, context: Context) -> Message:
            if message.metadata.message_type == "train":
                trained.append(context.node_id)
            return node(message, context)

        return handler

    grid = InProcessGrid([secure(counting(node)) for node in nodes])
    guarded = next(iter(grid.contexts.values()))
    guarded.node_config[NOISE_FLOOR_KEY] = 1.0
    options: dict = {"min_available_nodes": 4}
    if secure_run:
        dp = DPConfig(server_z, 1.0, max_noise_ratio=0)
        secure_config = SecureAggregationConfig(reconstruction_threshold=3)
        options |= {"differential_privacy": dp, "secure_aggregation": secure_config}
    arrays, metrics = train_round(FedAvg(**options), grid, state_to_arrays(reference))
    assert arrays is not None and metrics is not None
    assert metrics[NUM_FAILURES] == int(refused)
    assert (guarded.node_id in trained) is not refused
    errors = [r.error.reason for r in grid.received if r.has_error()]
    assert len(errors) == int(refused)
    if refused:
        assert "dp-min-noise-multiplier = 1" in errors[0]


def tampering(node: Callable, tamper: Callable[[Message], None]) -> Callable:
    """`node` behind a server that edits each message to it before its mods see it."""

    def handler(message: Message, context: Context) -> Message:
        tamper(message)
        return node(message, context)

    return handler


def floored_round(tamper: Callable[[Message], None]) -> tuple[dict, list[int], list[str], int]:
    """A secure DP round (z = C = 1, t = 3) over 4 nodes, the first with node-config floor
    z >= 1 and behind `tamper`: the round's metrics, who trained, the error replies and the
    floored node's id."""
    from fedfields.flower.secure_aggregation import NOISE_FLOOR_KEY

    reference = big_state(0)
    nodes = fixed_nodes(reference, [big_state(seed, 0.01) for seed in range(1, 5)], [1] * 4)
    trained: list[int] = []

    def counting(node: Callable) -> Callable:
        def handler(message: Message, context: Context) -> Message:
            if message.metadata.message_type == "train" and RECORD_KEY_CONFIGS not in (
                message.content.config_records
            ):
                trained.append(context.node_id)
            return node(message, context)

        return handler

    handlers = [secure(counting(node)) for node in nodes]
    handlers[0] = tampering(handlers[0], tamper)
    grid = InProcessGrid(handlers)
    floored = next(iter(grid.contexts))
    grid.contexts[floored].node_config[NOISE_FLOOR_KEY] = 1.0
    options = {
        "min_available_nodes": 4,
        "differential_privacy": DPConfig(1.0, 1.0, max_noise_ratio=0),
        "secure_aggregation": SecureAggregationConfig(reconstruction_threshold=3),
    }
    _, metrics = train_round(FedAvg(**options), grid, state_to_arrays(reference))
    errors = [r.error.reason for r in grid.received if r.has_error()]
    return metrics or {}, trained, errors, floored


def edit_train_config(**changes: object) -> Callable[[Message], None]:
    """A tamper that sets (value) or removes (None) train-config entries of train messages."""

    def tamper(message: Message) -> None:
        if message.metadata.message_type != "train" or "config" not in message.content:
            return
        config = message.content["config"]
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value

    return tamper


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"dp-clip-norm": None}, "'dp-clip-norm' is None"),
        ({"dp-clip-norm": math.inf}, "'dp-clip-norm' is inf"),
        ({"dp-clip-norm": 0.0}, "'dp-clip-norm' is 0.0"),
        ({"dp-clip-norm": "1.0"}, "'dp-clip-norm' is '1.0'"),
        ({"dp-gradient-clip-norm": math.nan}, "'dp-gradient-clip-norm' is nan"),
        ({"dp-min-holders": 1}, "'dp-min-holders' is 1"),
        ({"dp-min-holders": None}, "'dp-min-holders' is None"),
        ({"secure-weight": "num-examples"}, "weights the held payload by 'num-examples'"),
        ({"dp-noise-multiplier": 0.99}, "asked for z = 0.99"),
        ({"secure-aggregation": False}, "plaintext reply"),
    ],
)
def test_a_floored_node_refuses_a_message_it_could_not_noise_to_its_floor(
    changes: dict, why: str
) -> None:
    """A server that leaves out (or bends) what the node needs to clip and noise its share, or
    weights the held payload by an unnoised metric, gets an error from the floored node before
    it trains; the other three still form the round."""
    metrics, trained, errors, floored = floored_round(edit_train_config(**changes))
    assert floored not in trained
    assert len(trained) == 3 and metrics[NUM_FAILURES] == 1
    assert len(errors) == 1 and "dp-min-noise-multiplier = 1" in errors[0] and why in errors[0]


def test_a_floored_node_takes_part_in_an_honest_secure_dp_round() -> None:
    """The same round untampered: all four train and are summed (the refusals above are the
    tampering's, not the floor's)."""
    metrics, trained, errors, floored = floored_round(lambda message: None)
    assert floored in trained and len(trained) == 4
    assert errors == [] and metrics[NUM_FAILURES] == 0


def test_a_floored_node_sums_no_unnoised_held_metric() -> None:
    """A SecAgg+ stage whose layout asks the floored node for a held metric other than the
    weight and the noised bit (its train loss, which carries no noise) is refused: the node
    drops out of the masked sum instead of releasing it."""
    from fedfields.privacy.secagg_plan import decode_layout, encode_layout

    def ask_for_the_loss(message: Message) -> None:
        fit_config = message.content.config_records.get("fitins.config")
        if fit_config is None or SECURE_SUM_LAYOUT not in fit_config:
            return
        layout = decode_layout(str(fit_config[SECURE_SUM_LAYOUT]))
        fit_config[SECURE_SUM_LAYOUT] = encode_layout([*layout, ("metrics", TRAIN_LOSS, (1,))])

    metrics, trained, errors, floored = floored_round(ask_for_the_loss)
    assert floored in trained  # it trained and held: the stage is where it says no
    assert metrics[NUM_REPLIES] == 3  # the masked sum formed over the other three
    assert len(errors) == 1 and "carry no noise (train-loss)" in errors[0]


# ------------------------------------------------------------------ the write-ahead journal


class CrashingGrid(InProcessGrid):
    """Raises (the server crashes) when it is asked to push train messages carrying G."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        if any(m.metadata.message_type == "train" and GRADIENT in m.content for m in messages):
            raise RuntimeError("the server crashed sending G")
        return super().push_messages(messages)


def test_a_noised_g_released_before_a_crash_is_charged_when_the_run_resumes(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """DecentNeRF under central DP sends round 2's noised G with its train messages before
    the round is charged. The server writes the release to the run's journal first; when it
    crashes right there, the resumed run charges that release (z, 3 of 3) besides round 1's
    and the rerun round 2's, so the epsilon it reports is the one the releases earned."""
    from test_method_digests import SMALL_SCENE

    import strategies
    from simulations.federated_nerf import run_federated_nerf
    from simulations.job import DP_JOURNAL
    from simulations.run import client_app

    z = 0.01  # small enough that the noised alpha sums form aggregates
    config = {**SMALL_SCENE, "data-dir": str(crowd_dir), "state-dir": str(tmp_path / "nodes"),
              "run-dir": str(tmp_path / "run"), "strategy": "decentnerf", "num-server-rounds": 2,
              "dp-noise-multiplier": z, "dp-clip-norm": 1.0, "dp-max-noise-ratio": 0.0,
              "max-empty-rounds": 0}  # fmt: skip
    with pytest.raises(RuntimeError, match="crashed sending G"):
        run_federated_nerf(
            CrashingGrid([client_app(config)] * 3), strategies.parse_app_config(config)
        )
    journal = json.loads((tmp_path / "run" / DP_JOURNAL).read_text())
    assert journal == {"round": 2, "multipliers": [z], "sampled": 3, "population": 3}
    resumed = {**config, "resume": True}
    grid = InProcessGrid([client_app(resumed)] * 3, raise_errors=True)
    run_dir = run_federated_nerf(grid, strategies.parse_app_config(resumed))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    charges = [RoundCharge(1.0, z, 3, 3), RoundCharge(1.0, z, 3, 3),
               RoundCharge(1.0, z / math.sqrt(2), 3, 3)]  # fmt: skip
    assert lines[-1][DP_EPSILON] == pytest.approx(epsilon_of(charges, 1e-5), rel=1e-12)
    assert lines[0][DP_EPSILON] == pytest.approx(epsilon_of(charges[:1], 1e-5), rel=1e-12)


def test_a_malformed_journal_stops_the_resume_naming_the_file(tmp_path: Path) -> None:
    from simulations.job import DP_JOURNAL, charge_journal

    strategy = FedAvg(differential_privacy=DPConfig(1.0, 1.0))
    (tmp_path / DP_JOURNAL).write_text('{"round": 3, "multipliers": [1.0]')
    with pytest.raises(ResumeError, match="dp-journal.json is malformed"):
        charge_journal(tmp_path, 2, strategy)
    (tmp_path / DP_JOURNAL).write_text('{"round": 3, "multipliers": [1.0], "sampled": 2}')
    with pytest.raises(ResumeError, match="DP journal entry is malformed"):
        charge_journal(tmp_path, 2, strategy)
    charge_journal(tmp_path, 3, strategy)  # the round finished: nothing to charge
    assert strategy.privacy is not None and strategy.privacy.accountant.charges == ()
