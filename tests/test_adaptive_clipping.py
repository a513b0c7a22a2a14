"""Adaptive clipping (Andrew et al. 2021): the maths against Flower 1.41's implementation of
the same paper, central rounds against Flower's DifferentialPrivacyServerSideAdaptiveClipping
wrapper on the same replies, and distributed (SecAgg+) rounds against the central ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.supercore.differential_privacy import (
    adaptive_clip_inputs_inplace,
    compute_adaptive_noise_params,
)
from test_dp_federation import fixed_nodes, secure, train_round

from fedfields.flower import FedAvg
from fedfields.flower.protocol import arrays_to_state, state_to_arrays
from fedfields.flower.round import DP_EPSILON, DP_NEXT_CLIP_NORM, DP_ROUND_MULTIPLIER
from fedfields.privacy.accountant import RoundCharge, epsilon_of
from fedfields.privacy.adaptive_clipping import (
    CLIP_NORM_RANGE,
    AdaptiveClipping,
    combined_noise_multiplier,
    next_clip_norm,
    update_noise_multiplier,
)
from fedfields.privacy.dp import DPConfig, noise_generator
from fedfields.privacy.secagg_plan import SecureAggregationConfig
from simulations.in_process_grid import InProcessGrid
from strategies import parse_app_config

F64 = torch.float64
NORMS = (0.5, 1.0, 2.0, 4.0)
"""The four clients' update norms: C0 = 3 leaves 3 of them unclipped."""


def updates_with_norms(norms: tuple[float, ...], size: int = 64) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    updates = []
    for norm in norms:
        direction = torch.randn(size, generator=generator, dtype=F64)
        updates.append({"w": direction / direction.norm() * norm})
    return updates


@pytest.mark.parametrize(
    ("z", "sampled", "count_std"), [(1.0, 40, None), (0.5, 20, 2.0), (3.0, 200, None)]
)
def test_the_noise_split_is_flowers(z: float, sampled: int, count_std: float | None) -> None:
    """sigma_b (default n / 20) and z_Delta equal Flower's compute_adaptive_noise_params, and
    they compose back to z (Theorem 1)."""
    flower_count, flower_z = compute_adaptive_noise_params(z, sampled, count_std)
    sigma_b = AdaptiveClipping(count_stddev=count_std or 0.0).count_noise_std(sampled)
    assert sigma_b == pytest.approx(flower_count, rel=1e-12)
    assert update_noise_multiplier(z, sigma_b) == pytest.approx(flower_z, rel=1e-12)
    assert combined_noise_multiplier(update_noise_multiplier(z, sigma_b), sigma_b) == pytest.approx(
        z
    )


def test_a_count_noise_too_small_for_z_is_refused_as_flower_refuses_it() -> None:
    with pytest.raises(ValueError, match="too low"):
        compute_adaptive_noise_params(1.0, 10, None)  # sigma_b = 0.5 = z / 2
    with pytest.raises(ValueError, match="dp-clipped-count-stddev = 0.5 .* must exceed z / 2"):
        update_noise_multiplier(1.0, AdaptiveClipping().count_noise_std(10))


def test_the_unclipped_count_is_the_complement_of_flowers_norm_bits() -> None:
    updates = updates_with_norms(NORMS)
    bits = [adaptive_clip_inputs_inplace([u["w"].numpy().copy()], 3.0) for u in updates]
    assert bits == [False, False, False, True]  # Flower's bit: the update was clipped
    assert sum(float(u["w"].norm()) <= 3.0 for u in updates) == len(bits) - sum(bits)


@pytest.mark.parametrize("bad", [{"target_quantile": 1.5}, {"learning_rate": 0.0},
                                 {"count_stddev": -1.0}, {"learning_rate": math.inf}])  # fmt: skip
def test_settings_are_checked_naming_their_keys(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="'dp-"):
        AdaptiveClipping(**bad)


def central_round(clip_norm: float, z: float, count_std: float) -> tuple[FedAvg, dict, dict]:
    reference = {"w": torch.zeros(64, dtype=F64)}
    nodes = fixed_nodes(reference, updates_with_norms(NORMS), [1.0] * len(NORMS))
    dp = DPConfig(z, clip_norm, max_noise_ratio=0, adaptive=AdaptiveClipping(0.5, 0.2, count_std))
    strategy = FedAvg(min_available_nodes=len(NORMS), differential_privacy=dp)
    assert strategy.privacy is not None
    strategy.privacy.noise = noise_generator(11)
    arrays, metrics = train_round(strategy, InProcessGrid(nodes), state_to_arrays(reference))
    assert arrays is not None and metrics is not None
    return strategy, arrays_to_state(arrays), dict(metrics)


def test_a_central_round_clips_like_flowers_wrapper_and_moves_c_the_papers_way() -> None:
    """Same replies, C0 = 3, gamma = 0.5, eta = 0.2, negligible noise: the aggregate equals
    Flower's wrapper's (clipped at C0, mean over 4). 3 of 4 updates are unclipped, so the
    paper's update lowers C: 3 exp(-0.2 (0.75 - 0.5)). Flower's wrapper feeds the clipped
    fraction (0.25) into the same formula and raises C by exactly the inverse factor (a sign
    error in Flower 1.41: its C shrinks when every update is clipped)."""
    z = count_std = 1e-6
    strategy, ours, metrics = central_round(3.0, z, count_std)
    paper = next_clip_norm(3.0, 3.0, 4, AdaptiveClipping(0.5, 0.2))
    assert paper == pytest.approx(3.0 * math.exp(-0.2 * 0.25))
    assert metrics[DP_NEXT_CLIP_NORM] == pytest.approx(paper, rel=1e-5)
    reference = {"w": torch.zeros(64, dtype=F64)}
    flower_grid = InProcessGrid(fixed_nodes(reference, updates_with_norms(NORMS), [5] * 4))
    flower = DifferentialPrivacyServerSideAdaptiveClipping(
        FlowerFedAvg(min_available_nodes=4), noise_multiplier=z, num_sampled_clients=4,
        initial_clipping_norm=3.0, target_clipped_quantile=0.5, clip_norm_lr=0.2,
        clipped_count_stddev=count_std,
    )  # fmt: skip
    messages = flower.configure_train(1, state_to_arrays(reference), ConfigRecord(), flower_grid)
    oracle, _ = flower.aggregate_train(1, list(flower_grid.send_and_receive(messages)))
    assert oracle is not None
    torch.testing.assert_close(ours, arrays_to_state(oracle), rtol=0, atol=1e-5)
    assert flower.clipping_norm == pytest.approx(3.0**2 / paper, rel=1e-5)  # Flower's inverse
    assert metrics[DP_ROUND_MULTIPLIER] == z  # the pair of queries costs z
    assert strategy.privacy is not None and strategy.privacy.clip_norm == metrics[DP_NEXT_CLIP_NORM]


def test_c_converges_to_the_target_quantile_of_the_norms() -> None:
    """gamma = 0.5 over norms 0.5, 1, 2, 4: from C0 = 10 and from C0 = 0.1 the clip norm ends
    between the 2nd and 3rd norm (half the updates unclipped), with small count noise."""
    config = AdaptiveClipping(0.5, 0.5)
    for start in (10.0, 0.1):
        clip_norm = start
        for _ in range(60):
            unclipped = sum(norm <= clip_norm for norm in NORMS)
            clip_norm = next_clip_norm(clip_norm, unclipped, len(NORMS), config)
        assert 1.0 * 0.8 <= clip_norm <= 2.0 * 1.25, start


@pytest.mark.parametrize("holders_dropped", [0, 1])
def test_distributed_adaptive_clipping_moves_c_as_the_central_round_does(
    holders_dropped: int,
) -> None:
    """Secure FedAvg under DP with adaptive clipping, negligible noise: each client holds its
    noised bit beside its noised update; the secure sum of the bits moves C exactly as the
    central round's exact count does, and the aggregate is the clipped mean of the holders."""
    from test_secure_aggregation import dropping_after_key_sharing

    z = count_std = 1e-6
    reference = {"w": torch.zeros(64, dtype=F64)}
    updates = updates_with_norms(NORMS)
    nodes = [secure(node) for node in fixed_nodes(reference, updates, [1.0] * 4)]
    dropped = {3} if holders_dropped else set()  # the clipped one drops: 3 of 3 unclipped
    wrap = dropping_after_key_sharing(dropped)
    grid = InProcessGrid([wrap(node, k) for k, node in enumerate(nodes)])
    dp = DPConfig(z, 3.0, max_noise_ratio=0, adaptive=AdaptiveClipping(0.5, 0.2, count_std))
    strategy = FedAvg(min_available_nodes=4, differential_privacy=dp,
                      secure_aggregation=SecureAggregationConfig(reconstruction_threshold=3),
                      )  # fmt: skip
    arrays, metrics = train_round(strategy, grid, state_to_arrays(reference))
    assert arrays is not None and metrics is not None
    kept = [u for k, u in enumerate(updates) if k not in dropped]
    unclipped = sum(float(u["w"].norm()) <= 3.0 for u in kept)
    expected = next_clip_norm(3.0, unclipped, len(kept), AdaptiveClipping(0.5, 0.2))
    assert metrics[DP_NEXT_CLIP_NORM] == pytest.approx(expected, rel=1e-4)
    clipped_mean = sum(u["w"] * min(1.0, 3.0 / float(u["w"].norm())) for u in kept) / len(kept)
    torch.testing.assert_close(arrays_to_state(arrays)["w"], clipped_mean, rtol=0, atol=1e-4)
    assert metrics[DP_EPSILON] == pytest.approx(
        epsilon_of([RoundCharge(1.0, z * math.sqrt((len(kept) - 1) / 2))], 1e-5), rel=1e-9
    )
    sent = [m for m in grid.sent if m.metadata.message_type == "train" and "config" in m.content]
    assert all(m.content["config"]["dp-clipped-count-stddev"] == count_std for m in sent)


def test_the_run_config_builds_adaptive_clipping_and_refuses_bad_keys() -> None:
    config = parse_app_config({
        "dp-noise-multiplier": 1.0, "dp-clip-norm": 0.5, "dp-adaptive-clipping": True,
        "dp-target-quantile": 0.7, "dp-clip-norm-lr": 0.1, "dp-clipped-count-stddev": 2.0,
        "dp-gradient-clip-norm": 0.05,
    })  # fmt: skip
    dp = config.dp.dp_config()
    assert dp is not None and dp.adaptive == AdaptiveClipping(0.7, 0.1, 2.0)
    assert dp.gradient_clip_norm == 0.05
    with pytest.raises(ValueError, match="'dp-target-quantile' must be in \\[0, 1\\]"):
        parse_app_config({
            "dp-noise-multiplier": 1.0, "dp-clip-norm": 0.5, "dp-adaptive-clipping": True,
            "dp-target-quantile": 2.0,
        })  # fmt: skip
    assert np.isfinite(dp.clip_norm)


def test_a_count_noise_too_small_is_refused_by_the_plan_before_any_file(tmp_path) -> None:
    """dp-clipped-count-stddev = 0.4 with z = 1: the privacy plan, checked before the run
    directory is made, refuses it naming the key."""
    dp = DPConfig(1.0, 1.0, adaptive=AdaptiveClipping(count_stddev=0.4))
    with pytest.raises(ValueError, match="dp-clipped-count-stddev = 0.4"):
        FedAvg(differential_privacy=dp).check_privacy_plan(1, 3)


def test_a_secure_decentnerf_run_with_adaptive_clipping_and_its_own_gradient_clip() -> None:
    """strategy.start (its summary reads the client config before sigma_b is fixed) with
    SecAgg+, DP, adaptive clipping and dp-gradient-clip-norm: every round aggregates, rounds
    2-3 unmask both sums, each charged z sqrt(3/2) (4 holders, t = 3: one holder fewer over
    the t - 1 its shares are calibrated to) and combined over the two, and C moves each
    round."""
    from test_strategies import heterogeneous_problems, initial_state, least_squares_app

    from fedfields.flower import DecentNeRF

    problems = heterogeneous_problems(4)
    app = secure(least_squares_app(problems, 0.05, (0.5, 1.0, 1.5, 1.0)))
    dp = DPConfig(0.01, 2.0, max_noise_ratio=0, adaptive=AdaptiveClipping(count_stddev=1.0),
                  gradient_clip_norm=0.5)  # fmt: skip
    secure_config = SecureAggregationConfig()
    strategy = DecentNeRF(min_available_nodes=4, local_steps=2, alpha_lr=0.0,
                          differential_privacy=dp, secure_aggregation=secure_config)  # fmt: skip
    result = strategy.start(InProcessGrid([app] * 4), state_to_arrays(initial_state()), 3)
    metrics = result.train_metrics_clientapp
    assert strategy.rounds_aggregated == 3
    assert [metrics[r]["secure-sums"] for r in (1, 2, 3)] == [1, 2, 2]
    per_sum = 0.01 * math.sqrt(3 / 2)
    assert [metrics[r][DP_ROUND_MULTIPLIER] for r in (1, 2, 3)] == pytest.approx(
        [per_sum, per_sum / math.sqrt(2), per_sum / math.sqrt(2)]
    )
    norms = [2.0] + [metrics[r][DP_NEXT_CLIP_NORM] for r in (1, 2, 3)]
    assert all(a != b for a, b in zip(norms, norms[1:], strict=False))


@pytest.mark.parametrize(
    ("quantile", "rate", "noised", "bound"),
    [(0.0, 10.0, 3.0, CLIP_NORM_RANGE[0]), (1.0, 10.0, -1e300, CLIP_NORM_RANGE[1]),
     (1.0, 10.0, 0.0, CLIP_NORM_RANGE[1])],
)  # fmt: skip
def test_accepted_adaptive_settings_keep_the_clip_norm_in_range_for_any_count(
    quantile: float, rate: float, noised: float, bound: float
) -> None:
    """The extremes the parser accepts (gamma 0 or 1, eta at its cap) pushed by 40 rounds of
    the most extreme counts hold C at the edge of its range, never 0, inf or an
    OverflowError; a count that is not a number leaves C where it was."""
    config = AdaptiveClipping(quantile, rate)
    clip_norm = 1.0
    for _ in range(40):
        clip_norm = next_clip_norm(clip_norm, noised, 3, config)
    assert clip_norm == bound
    assert next_clip_norm(0.7, math.nan, 3, config) == 0.7
    with pytest.raises(ValueError, match="'dp-clip-norm-lr' must be in"):
        AdaptiveClipping(0.5, 1e300)
