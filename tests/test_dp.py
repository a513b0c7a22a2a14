"""Client-level DP (fedfields.privacy.dp) against independent references: Flower's own clipping
and noise scale (flwr.supercore.differential_privacy), Flower's RdpAccountant, the sampled
Gaussian's closed-form Renyi DP (Mironov, Talwar and Zhang 2019) and Abadi et al.'s published
epsilon; the run-config's dp-* keys and the job's refusal while DP is not wired in."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from dp_reference import flower_epsilons, headline_epsilons
from flwr.supercore.differential_privacy import (
    compute_clip_model_update,
    compute_stdv,
    get_norm,
)

from fedfields.config import FederatedConfig
from fedfields.flower import FedAvg
from fedfields.privacy.accountant import (
    EPSILON_METRIC,
    EPSILON_POISSON_METRIC,
    MAX_ROUNDS,
    DPAccountant,
    RoundCharge,
    epsilon_of,
    epsilon_pld,
    epsilon_poisson,
    rounds_within,
)
from fedfields.privacy.dp import (
    DEFAULT_MAX_NOISE_RATIO,
    DPConfig,
    NonFiniteUpdateError,
    add_gaussian_noise,
    central_noise_std,
    clip_model_update,
    clip_update,
    distributed_noise_std,
    effective_noise_multiplier,
    gaussian_noise,
    mean_noise_std,
    noise_generator,
    noise_ratio,
)
from simulations.server_app import run_job
from strategies import parse_app_config

INTEGER_ORDERS = tuple(range(2, 65))
"""Orders at which the sampled Gaussian's RDP has a closed form (and fast to compose)."""


def independent_norm(state: dict[str, torch.Tensor]) -> float:
    """||state|| from numpy float64 with exact summation (no code shared with the module)."""
    flat = np.concatenate([t.double().numpy().ravel() for t in state.values()])
    largest = float(np.abs(flat).max()) if flat.size else 0.0
    if largest == 0.0:
        return 0.0
    return largest * math.sqrt(math.fsum((flat / largest) ** 2))


def random_update(generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One to four tensors of random shapes at a random scale that dtype can hold."""
    largest_exponent = {torch.float16: 3, torch.float32: 30, torch.float64: 200}[dtype]
    exponent = int(torch.randint(-6, largest_exponent + 1, (1,), generator=generator))
    update = {}
    for index in range(int(torch.randint(1, 5, (1,), generator=generator))):
        shape = tuple(
            int(s) for s in torch.randint(1, 7, (int(index % 3) + 1,), generator=generator)
        )
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * 10.0**exponent
        update[f"layer{index}.weight"] = values.to(dtype)
    return update


def as_state(arrays: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Flower's list of arrays as a state dict keyed "0", "1", ... (ArrayRecord's keys)."""
    return {str(index): torch.from_numpy(array.copy()) for index, array in enumerate(arrays)}


# ---------------------------------------------------------------- clipping


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_clipping_never_lets_an_update_exceed_the_clip_norm(dtype: torch.dtype) -> None:
    """Over many random updates (norms from 1e-6 to 1e200) and clip norms: the clipped update's
    norm, measured independently, is <= C; one already inside is returned unchanged; one
    outside keeps its direction and lands on C."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(150):
        update = random_update(generator, dtype)
        clip_norm = float(10.0 ** torch.empty(1).uniform_(-3, 3, generator=generator))
        clipped, norm = clip_update(update, clip_norm)
        assert norm == pytest.approx(independent_norm(update), rel=1e-12)
        assert independent_norm(clipped) <= clip_norm * (1 + 1e-12)
        assert [(t.dtype, t.shape) for t in clipped.values()] == [
            (t.dtype, t.shape) for t in update.values()
        ]
        if norm <= clip_norm:
            assert all(torch.equal(clipped[k], update[k]) for k in update)
        else:
            unit = max(4 * torch.finfo(dtype).eps, 2e-12)
            assert independent_norm(clipped) >= clip_norm * (1 - unit)
            for key, value in update.items():
                torch.testing.assert_close(
                    clipped[key].double(),
                    value.double() * (clip_norm / norm),
                    rtol=unit,
                    atol=torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps,  # subnormals
                )


def test_hostile_updates_are_refused_or_clipped_without_overflow() -> None:
    nan = {"a": torch.ones(3), "b": torch.tensor([1.0, math.nan])}
    with pytest.raises(NonFiniteUpdateError, match="update key 'b': NaN or infinite"):
        clip_update(nan, 1.0)
    with pytest.raises(NonFiniteUpdateError, match="key 'a'"):
        clip_update({"a": torch.tensor([math.inf], dtype=torch.float16)}, 1.0)
    with pytest.raises(ValueError, match="update key 'steps': torch.int64 is not floating"):
        clip_update({"steps": torch.tensor([3])}, 1.0)
    with pytest.raises(ValueError, match="no tensors"):
        clip_update({}, 1.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="clip norm must be finite and > 0"):
            clip_update({"a": torch.ones(2)}, bad)
    # a zero update (a client that did not move) is its own clip
    zero = {"a": torch.zeros(4, dtype=torch.float16), "b": torch.zeros(2, 2)}
    clipped, norm = clip_update(zero, 0.5)
    assert norm == 0.0 and all(torch.equal(clipped[k], zero[k]) for k in zero)
    # squares beyond float64's range: the norm is still exact, the clip lands on C
    huge = {"a": torch.full((3,), 1e200, dtype=torch.float64), "b": torch.tensor([1e30])}
    clipped, norm = clip_update(huge, 2.0)
    assert norm == pytest.approx(math.sqrt(3) * 1e200, rel=1e-12)
    assert independent_norm(clipped) == pytest.approx(2.0, rel=1e-6)  # float32's margin
    # a float16 model whose difference from the global is beyond float16's range
    local = {"a": torch.full((2,), 6e4, dtype=torch.float16)}
    reference = {"a": torch.full((2,), -6e4, dtype=torch.float16)}
    clipped, norm = clip_model_update(local, reference, 1.0)
    assert (
        norm == pytest.approx(1.2e5 * math.sqrt(2), rel=1e-3)
        and clipped["a"].dtype == torch.float16
    )
    assert independent_norm(clipped) <= 1.0
    # the unclipped update is a copy, never the caller's tensors
    small = {"a": torch.zeros(3, dtype=torch.float64)}
    clip_update(small, 1.0)[0]["a"] += 1
    assert not small["a"].any()
    # float16 whose squares overflow float16 itself
    wide = {"a": torch.full((1000,), 6e4, dtype=torch.float16)}
    clipped, norm = clip_update(wide, 1.0)
    assert norm == pytest.approx(6e4 * math.sqrt(1000), rel=1e-3)
    assert independent_norm(clipped) <= 1.0


@pytest.mark.parametrize(
    ("dtype", "rtol"), [(np.float32, 1e-6), (np.float64, 1e-11)], ids=["float32", "float64"]
)
def test_the_clip_is_flowers_compute_clip_model_update(dtype: type, rtol: float) -> None:
    """Flower's FlatClip (the fixed-clipping wrappers and fixedclipping_mod) as the oracle:
    same norm, same clipped model reference + clip(local - reference), up to our safety margin
    of a few units of roundoff."""
    rng = np.random.default_rng(3)
    for clip_norm in (0.1, 1.0, 5.0, 1e3):
        shapes = [(4, 3), (3,), (2, 2, 2)]
        reference = [rng.normal(size=s).astype(dtype) for s in shapes]
        local = [r + rng.normal(scale=2.0, size=r.shape).astype(dtype) for r in reference]
        flower = [a.copy() for a in local]
        compute_clip_model_update(flower, reference, clip_norm)

        clipped, norm = clip_model_update(as_state(local), as_state(reference), clip_norm)
        difference = [l_ - r for l_, r in zip(local, reference, strict=True)]
        assert norm == pytest.approx(
            get_norm(difference), rel=1e-6 if dtype is np.float32 else 1e-12
        )
        for index, expected in enumerate(flower):
            ours = reference[index].astype(np.float64) + clipped[str(index)].double().numpy()
            np.testing.assert_allclose(ours, expected, rtol=rtol, atol=rtol * clip_norm)


# ---------------------------------------------------------------- noise


def test_central_noise_has_std_z_c_on_the_sum_and_flowers_z_c_over_n_on_the_mean() -> None:
    z, clip_norm, clients = 1.3, 0.7, 8
    assert central_noise_std(z, clip_norm) == pytest.approx(z * clip_norm)
    assert mean_noise_std(z, clip_norm, clients) == pytest.approx(
        compute_stdv(z, clip_norm, clients)
    )
    summed = {"w": torch.zeros(200_000), "b": torch.zeros(7)}
    noised = add_gaussian_noise(summed, central_noise_std(z, clip_norm), noise_generator(11))
    measured = float(noised["w"].double().std())
    # the std of 200k draws is within 1% (about six standard errors) of the true one
    assert measured == pytest.approx(z * clip_norm, rel=0.01)
    assert abs(float(noised["w"].double().mean())) < 5 * z * clip_norm / math.sqrt(200_000)
    assert measured / clients == pytest.approx(compute_stdv(z, clip_norm, clients), rel=0.01)


def test_distributed_noise_shares_leave_z_c_one_holder_fewer_and_are_charged_so() -> None:
    """Calibrated to t = 7 holders, each of the 7 clients adds N(0, z^2 C^2 / 6): any 6 shares
    sum to std z C, all 7 to z C sqrt(7/6). A sum of h holders is charged the multiplier of its
    neighbour with one holder fewer, z sqrt((h - 1) / (t - 1)): measured on h - 1 shares."""
    z, clip_norm, clients, size = 1.1, 2.0, 7, 100_000
    share_std = distributed_noise_std(z, clip_norm, clients)
    assert share_std == pytest.approx(z * clip_norm / math.sqrt(clients - 1))
    zero = {"w": torch.zeros(size)}
    shares = [add_gaussian_noise(zero, share_std, noise_generator(100 + k))["w"] for k in range(7)]
    all_shares = float(torch.stack(shares).sum(0).std())
    assert all_shares == pytest.approx(z * clip_norm * math.sqrt(7 / 6), rel=0.015)
    assert float(torch.stack(shares[1:]).sum(0).std()) == pytest.approx(z * clip_norm, rel=0.015)
    assert effective_noise_multiplier(z, clients, clients) == pytest.approx(z)
    for summed in (7, 9):  # h = t and h > t: the neighbour one holder fewer holds h - 1 shares
        charged = effective_noise_multiplier(z, clients, summed)
        assert charged == pytest.approx(z * math.sqrt((summed - 1) / (clients - 1)))
        fewer = [add_gaussian_noise(zero, share_std, noise_generator(200 + k))["w"]
                 for k in range(summed - 1)]  # fmt: skip
        assert float(torch.stack(fewer).sum(0).std()) == pytest.approx(
            charged * clip_norm, rel=0.015
        )
        assert charged >= z
    for bad_calibration, bad_summed in ((1, 3), (7, 0)):
        with pytest.raises(ValueError, match="must be >= "):
            effective_noise_multiplier(z, bad_calibration, bad_summed)


def test_noise_is_reproducible_under_a_seed_and_secret_without_one() -> None:
    like = {"a": torch.zeros(5), "b": torch.zeros(2, 3, dtype=torch.float16)}
    first = gaussian_noise(like, 1.0, noise_generator(5))
    again = gaussian_noise(like, 1.0, noise_generator(5))
    assert all(torch.equal(first[k], again[k]) for k in like)
    other = gaussian_noise(like, 1.0, noise_generator(6))
    assert not torch.equal(first["a"], other["a"])
    unseeded = [gaussian_noise(like, 1.0, noise_generator())["a"] for _ in range(2)]
    assert not torch.equal(*unseeded)
    noised = add_gaussian_noise(like, 1.0, noise_generator(5))
    assert noised["b"].dtype == torch.float16 and noised["a"].dtype == torch.float32
    with pytest.raises(NonFiniteUpdateError):
        add_gaussian_noise({"a": torch.tensor([math.nan])}, 1.0, noise_generator(5))


# ---------------------------------------------------------------- accounting


def sampled_gaussian_rdp(q: float, sigma: float, order: int) -> float:
    """RDP at an integer order of one Poisson-subsampled Gaussian round, in closed form:
    log(sum_k C(a,k) (1-q)^(a-k) q^k exp((k^2-k) / (2 sigma^2))) / (a-1) (Mironov et al. 2019)."""
    terms = [
        math.log(math.comb(order, k))
        + (order - k) * math.log1p(-q)
        + k * math.log(q)
        + (k * k - k) / (2 * sigma**2)
        for k in range(order + 1)
    ]
    top = max(terms)
    return (top + math.log(math.fsum(math.exp(t - top) for t in terms))) / (order - 1)


def test_the_poisson_figure_reproduces_abadi_et_al_and_the_closed_form() -> None:
    """The Poisson column (an assumption the runs do not meet). Abadi et al. 2016 (Sec. 3.1):
    q = 0.01, sigma = 4, delta = 1e-5, T = 10000 steps gives
    epsilon ~ 1.26 with the moments accountant's conversion. The closed-form RDP with that
    conversion reproduces 1.26; with the tighter conversion dp-accounting uses (Canonne et al.
    2020, Prop. 12) it must equal our accountant's epsilon; the default orders do no worse."""
    q, sigma, steps, delta = 0.01, 4.0, 10_000, 1e-5
    rdp = {a: steps * sampled_gaussian_rdp(q, sigma, a) for a in INTEGER_ORDERS}
    moments = min(rdp[a] + math.log(1 / delta) / (a - 1) for a in range(2, 33))
    assert round(moments, 2) == 1.26
    tight = min(rdp[a] + math.log1p(-1 / a) - math.log(delta * a) / (a - 1) for a in rdp)
    ours = epsilon_poisson([RoundCharge(q, sigma)] * steps, delta, INTEGER_ORDERS)
    assert ours == pytest.approx(tight, rel=1e-10)
    assert tight == pytest.approx(1.0354900660, rel=1e-9)
    assert epsilon_poisson([RoundCharge(q, sigma)] * steps, delta) <= ours + 1e-12


def test_the_poisson_figure_matches_dp_accountings_published_rdp() -> None:
    """dp-accounting's own test values: q = 0.01, z = 2.5, 50 rounds have RDP 2.18075656e-03 at
    order 5 and 2.38460375e-02 at order 50; with one order the epsilon is that RDP converted."""
    delta = 1e-5
    for order, published in ((5, 2.18075656e-03), (50, 2.38460375e-02)):
        epsilon = epsilon_poisson([RoundCharge(0.01, 2.5)] * 50, delta, [order])
        expected = published + math.log1p(-1 / order) - math.log(delta * order) / (order - 1)
        assert epsilon == pytest.approx(expected, rel=1e-8)


def test_the_accountant_equals_flowers_rdp_accountants_and_grows_with_rounds() -> None:
    """5 of 20 clients per round, z = 1.0, delta = 1e-5: after each round the headline equals
    Flower's RdpAccountant without replacement at z/2 (replace-one) and the Poisson column
    Flower's Poisson one (add-or-remove-one), to 1e-12; both grow."""
    delta, population, sampled, z = 1e-5, 20, 5, 1.0
    ours = DPAccountant(delta)
    epsilons, poisson = [], []
    for _ in range(4):
        epsilons.append(ours.charge(sampled / population, z, sampled, population))
        poisson.append(ours.report()[EPSILON_POISSON_METRIC])
    assert epsilons == pytest.approx(headline_epsilons(sampled, population, z, 4, delta), rel=1e-12)
    assert poisson == pytest.approx(flower_epsilons(sampled, population, z, 4, delta), rel=1e-12)
    assert all(b > a > 0 for a, b in zip(epsilons, epsilons[1:], strict=False))
    assert all(p < e for p, e in zip(poisson, epsilons, strict=True))  # Poisson flatters
    # a round whose dropouts lowered the noise costs more than a full one
    full = DPAccountant(delta).charge(0.25, z, 5, 20)
    short = DPAccountant(delta).charge(0.25, effective_noise_multiplier(z, 5, 3), 5, 20)
    assert short > full
    # no noise: unbounded; nobody sampled: free
    assert DPAccountant(delta).charge(0.25, 0.0, 5, 20) == math.inf
    assert DPAccountant(delta).charge(0.0, 1.0, 0, 20) == 0.0


def gaussian_delta(epsilon: float, mu: float) -> float:
    """The exact privacy profile of the Gaussian mechanism whose noise std is 1/mu of its
    sensitivity (Balle and Wang 2018, Theorem 8)."""
    from scipy.stats import norm

    return float(
        norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon) * norm.cdf(-mu / 2 - epsilon / mu)
    )


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The least epsilon at which that mechanism is (epsilon, delta)-DP, by bisection."""
    from scipy.optimize import brentq

    return float(brentq(lambda epsilon: gaussian_delta(epsilon, mu) - delta, 0.0, 500.0))


@pytest.mark.parametrize(("z", "rounds"), [(1.0, 1), (2.0, 4), (4.0, 20)])
def test_every_client_sampled_the_headline_is_a_bound_on_the_exact_gaussian(
    z: float, rounds: int
) -> None:
    """k = n: R rounds of the sum of clipped updates plus N(0, z^2 C^2) compose to one
    Gaussian mechanism with mu = sqrt(R) * 2C / (z C) under replace-one neighbours (one update
    swapped moves the sum by up to 2C). Our epsilon must lie between that mechanism's exact
    epsilon and the classical RDP conversion of R alpha mu_1^2 / 2, neither computed by
    dp-accounting; accounting for sensitivity C (z in place of z/2) falls below the exact
    figure, so a wrong sensitivity argument fails here."""
    delta, n = 1e-5, 10
    ours = epsilon_of([RoundCharge(1.0, z, n, n)] * rounds, delta)
    exact = exact_gaussian_epsilon(math.sqrt(rounds) * 2 / z, delta)
    orders = [1 + i / 100 for i in range(1, 20_000)]
    classical = min(rounds * a * (2 / z) ** 2 / 2 + math.log(1 / delta) / (a - 1) for a in orders)
    assert exact <= ours <= classical
    assert ours <= 1.1 * exact  # and a useful bound
    half_sensitivity = epsilon_of([RoundCharge(1.0, 2 * z, n, n)] * rounds, delta)
    assert half_sensitivity < exact


def mixture_delta(epsilon: float, q: float, sigma: float) -> float:
    """delta(epsilon) of one round on a pair of replace-one neighbours, by quadrature: the
    others' updates 0, the swapped client's +C against -C (C = 1), sampled with probability
    q = k/n, sum noised by N(0, sigma^2): P = (1-q) N(0) + q N(+1) against (1-q) N(0) + q N(-1)."""
    from scipy.stats import norm

    x = np.linspace(-1 - 40 * sigma, 1 + 40 * sigma, 2_000_001)
    p = (1 - q) * norm.pdf(x, 0, sigma) + q * norm.pdf(x, 1, sigma)
    other = (1 - q) * norm.pdf(x, 0, sigma) + q * norm.pdf(x, -1, sigma)
    return float(np.trapezoid(np.maximum(p - math.exp(epsilon) * other, 0.0), x))


def test_a_sampled_round_is_at_least_as_private_as_the_headline_says_on_a_worst_pair() -> None:
    """5 of 10 clients, z = 1, one round: a concrete pair of neighbouring datasets, integrated
    numerically, must not leak more than delta at the headline epsilon; at the epsilon of the
    wrong sensitivity (z in place of z/2) the same pair does."""
    delta, q, z = 1e-5, 0.5, 1.0
    ours = epsilon_of([RoundCharge(q, z, 5, 10)], delta)
    assert mixture_delta(ours, q, z) <= delta
    wrong = epsilon_of([RoundCharge(q, 2 * z, 5, 10)], delta)
    assert mixture_delta(wrong, q, z) > delta


def test_rounds_within_is_the_largest_plan_that_meets_the_target() -> None:
    q, z, delta, target = 0.05, 2.0, 1e-5, 3.0
    rounds = rounds_within(target, q, z, delta, orders=INTEGER_ORDERS)
    assert rounds > 1
    charge = RoundCharge(q, z)
    assert epsilon_of([charge] * rounds, delta, INTEGER_ORDERS) <= target
    assert epsilon_of([charge] * (rounds + 1), delta, INTEGER_ORDERS) > target
    # after some rounds are spent, the rest of the budget allows exactly the remainder
    accountant = DPAccountant(delta, orders=INTEGER_ORDERS)
    for _ in range(3):
        accountant.charge(q, z)
    left = accountant.rounds_left(target, q, z)
    assert left == rounds - 3
    assert accountant.epsilon_after(q, z, left) <= target < accountant.epsilon_after(q, z, left + 1)
    assert len(accountant.charges) == 3  # looking ahead charged nothing
    assert rounds_within(target, q, 0.0, delta, orders=INTEGER_ORDERS) == 0
    assert rounds_within(target, 0.0, z, delta, orders=INTEGER_ORDERS) == MAX_ROUNDS
    assert rounds_within(0.01, 1.0, 1.0, delta, orders=INTEGER_ORDERS) == 0
    with pytest.raises(ValueError, match="target epsilon must be finite and > 0"):
        rounds_within(0.0, q, z, delta)


def test_the_accountant_state_survives_a_resume() -> None:
    delta = 1e-6
    uninterrupted = DPAccountant(delta, orders=INTEGER_ORDERS)
    first = DPAccountant(delta, orders=INTEGER_ORDERS)
    for q, z in ((0.25, 1.0), (0.2, 0.9), (0.25, 1.0)):
        uninterrupted.charge(q, z)
        first.charge(q, z)
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["charges"] == [[0.25, 1.0, 0, 0], [0.2, 0.9, 0, 0], [0.25, 1.0, 0, 0]]
    resumed = DPAccountant.from_state_dict(saved)
    assert resumed.epsilon() == first.epsilon()
    assert resumed.charge(0.3, 1.1) == pytest.approx(uninterrupted.charge(0.3, 1.1), rel=1e-12)
    for bad in ({"charges": [[0.2, 1.0]]}, {"delta": 1e-5, "charges": [[1.5, 1.0]]},
                {"delta": 2.0, "charges": []}, {"delta": 1e-5, "charges": [[0.1]]}):  # fmt: skip
        with pytest.raises(ValueError, match="DP accountant state is malformed"):
            DPAccountant.from_state_dict(bad)


def test_the_headline_is_the_bound_for_k_of_n_without_replacement() -> None:
    """5 of 10 clients sampled without replacement, z = 1, 2 rounds: the headline is 15.4 (the
    bound for what runs), the Poisson column 5.38 (the figure reported before 2026-12-05); a
    charge known by its rate alone (a plan, an older checkpoint) is accounted as k/n = q."""
    delta = 1e-5
    accountant = DPAccountant(delta)
    for _ in range(2):
        accountant.charge(0.5, 1.0, 5, 10)
    report = accountant.report()
    assert report[EPSILON_METRIC] == pytest.approx(headline_epsilons(5, 10, 1.0, 2)[-1], rel=1e-12)
    assert report[EPSILON_METRIC] == pytest.approx(15.417, abs=1e-3)
    assert report[EPSILON_POISSON_METRIC] == pytest.approx(5.377, abs=1e-3)
    by_rate = DPAccountant(delta, [RoundCharge(0.5, 1.0)] * 2)
    assert by_rate.epsilon() == pytest.approx(report[EPSILON_METRIC], rel=1e-12)


def test_pld_epsilon_is_dp_accountings_and_tighter_than_rdp() -> None:
    """The PLD figure bounds dp-accounting's PLD accountant at its default (finer)
    discretisation from above, within 1%, and lies below the RDP bound of the same rounds."""
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    delta, charges = 1e-5, [RoundCharge(0.05, 1.1)] * 100
    reference = PLDAccountant()
    reference.compose(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.1)), 100)
    ours = epsilon_pld(charges, delta)
    assert reference.get_epsilon(delta) <= ours <= 1.01 * reference.get_epsilon(delta)
    assert ours < epsilon_poisson(charges, delta)
    assert epsilon_pld([], delta) == 0.0
    assert epsilon_pld([RoundCharge(0.5, 0.0)], delta) == math.inf
    assert epsilon_pld([RoundCharge(0.5, 0.1)], delta) is None  # RDP's figure stands alone


def test_an_older_accountant_state_of_pairs_still_loads() -> None:
    state = {"delta": 1e-5, "orders": None, "charges": [[0.25, 1.0], [0.25, 1.0]]}
    resumed = DPAccountant.from_state_dict(state)
    assert resumed.charges == (RoundCharge(0.25, 1.0),) * 2
    counted = DPAccountant(1e-5)
    counted.charge(0.25, 1.0, 5, 20)
    assert DPAccountant.from_state_dict(counted.state_dict()).charges == counted.charges
    with pytest.raises(ValueError, match="DP accountant state is malformed"):
        DPAccountant.from_state_dict({"delta": 1e-5, "charges": [[0.25, 1.0, 9, 5]]})


# ---------------------------------------------------------------- configuration


def test_dp_config_validation_names_the_run_config_key() -> None:
    assert not DPConfig().enabled
    assert DPConfig(noise_multiplier=1.0, clip_norm=0.5).enabled
    with pytest.raises(
        ValueError,
        match=r"'dp-noise-multiplier' must be finite and 0 \(off\) or in \[1e-12, 1000\]",
    ):
        DPConfig(noise_multiplier=-1.0, clip_norm=1.0)
    with pytest.raises(ValueError, match="'dp-clip-norm' must be > 0 when 'dp-noise-multiplier'"):
        DPConfig(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="'dp-delta' must be finite and in \\(0, 1\\), got 1.0"):
        DPConfig(noise_multiplier=1.0, clip_norm=1.0, delta=1.0)
    with pytest.raises(ValueError, match="'dp-target-epsilon' must be finite and >= 0"):
        DPConfig(noise_multiplier=1.0, clip_norm=1.0, target_epsilon=math.inf)


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"dp-noise-multiplier": -0.5}, "run-config 'dp-noise-multiplier' must be finite and 0 "),
        ({"dp-noise-multiplier": 1.0}, "run-config 'dp-clip-norm' must be > 0 when"),
        (
            {"dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0, "dp-delta": 0.0},
            "run-config 'dp-delta' must be finite and in \\(0, 1\\), got 0.0",
        ),
        (
            {"dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0, "dp-target-epsilon": -2.0},
            "run-config 'dp-target-epsilon' must be finite and >= 0, got -2.0",
        ),
        ({"dp-delta": "small"}, "run-config 'dp-delta' must be float, got 'small'"),
        (
            {"dp-clip-norm": 1.0},
            "run-config 'dp-clip-norm' = 1.0 is read only with dp-noise-multiplier > 0",
        ),
        (
            {"mode": "split", "dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0},
            "'dp-noise-multiplier' belongs to the differential privacy section, used by every "
            "task in mode='federated'",
        ),
        (
            {"dp-adaptive-clipping": True},
            "run-config 'dp-adaptive-clipping' = True is read only with dp-noise-multiplier > 0",
        ),
        (
            {"dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0, "dp-target-quantile": 0.9},
            "run-config 'dp-target-quantile' = 0.9 is read only with dp-adaptive-clipping=true",
        ),
        (
            {"strategy": "fedavg", "dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0,
             "dp-gradient-clip-norm": 2.0},
            "run-config 'dp-gradient-clip-norm' = 2.0 is read only with strategy='decentnerf'",
        ),
        (
            {"dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0, "dp-adaptive-clipping": True,
             "dp-clip-norm-lr": 1e300},
            "'dp-clip-norm-lr' must be in \\(0, 10\\]",
        ),
        ({"seed": -1}, "run-config 'seed' must be in \\[0, 2147483647\\], got -1"),
        ({"seed": 1 << 31}, "run-config 'seed' must be in \\[0, 2147483647\\]"),
        ({"strategy": "fedavgm", "server-momentum": 1.0},
         "'server-momentum' must be in \\[0, 1\\)"),
        ({"strategy": "fedadam", "tau": 1e-300}, "'tau' must be finite and >= 1e-09"),
    ],
)  # fmt: skip
def test_bad_dp_run_config_gets_one_error_naming_the_key(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_app_config(run_config)


@pytest.mark.parametrize("task", ["scene", "faces"])
def test_a_dp_run_config_parses_and_the_job_refuses_a_plan_beyond_the_target(
    task: str, tmp_path: Path
) -> None:
    """Both jobs refuse a plan whose projected epsilon exceeds dp-target-epsilon before they
    touch the grid or write anything."""
    run_config = {
        "dp-noise-multiplier": 1.1,
        "dp-clip-norm": 0.5,
        "dp-delta": 1e-6,
        "dp-target-epsilon": 8,
    }
    config = parse_app_config(run_config)
    assert config.dp.dp_config() == DPConfig(1.1, 0.5, 1e-6, 8.0)
    assert parse_app_config({"task": "faces", **run_config}).dp.dp_config()
    assert FederatedConfig().dp.dp_config() is None

    class UntouchableGrid:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the job used the grid ({name}) before refusing")

    planned = {**run_config, "dp-target-epsilon": 0.5, "task": task, "run-dir": str(tmp_path)}
    with pytest.raises(ValueError, match="'dp-target-epsilon' = 0.5 cannot be met: "):
        run_job(UntouchableGrid(), planned)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir()), "a refused plan wrote something"


# ---------------------------------------------------------------- the pre-flight noise check


def test_the_noise_ratio_is_the_noise_norm_on_the_mean_over_the_clip_norm() -> None:
    """z sqrt(d) / n, checked by drawing the noise: the mean of n clipped updates carries
    N(0, (z C / n)^2) per entry, whose norm over d entries is about z C sqrt(d) / n."""
    z, clip, d, n = 1.5, 2.0, 40_000, 8
    noise = gaussian_noise({"w": torch.zeros(d)}, central_noise_std(z, clip), noise_generator(5))
    measured = float(noise["w"].double().norm()) / n / clip
    assert noise_ratio(z, d, n) == pytest.approx(measured, rel=0.02)
    assert noise_ratio(1.0, 311**2 * 9, 3) == pytest.approx(311.0)  # the scene figure


def one_dp_round(max_noise_ratio: float, params: int, clients: int) -> FedAvg:
    """A central-DP FedAvg round over `clients` nodes on a model of `params` entries."""
    from flwr.app import ConfigRecord
    from test_reply_faults import node

    from fedfields.flower.protocol import ARRAYS, NUM_EXAMPLES, state_to_arrays
    from simulations.in_process_grid import InProcessGrid

    state = {"w": torch.zeros(params, dtype=torch.float64)}
    grid = InProcessGrid([node({ARRAYS: state}, {NUM_EXAMPLES: 1.0})] * clients)
    dp = DPConfig(1.0, 1.0, max_noise_ratio=max_noise_ratio)
    strategy = FedAvg(min_available_nodes=clients, differential_privacy=dp)
    strategy.privacy.noise = noise_generator(0)  # type: ignore[union-attr]
    messages = strategy.configure_train(1, state_to_arrays(state), ConfigRecord(), grid)
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    return strategy


def test_a_dp_run_whose_noise_drowns_every_update_is_refused_before_round_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """d = 400, n = 2, z = 1: ratio 10 passes with a warning; d = 484 (ratio 11) is refused
    naming dp-max-noise-ratio before any message is sent; 0 lifts the limit."""
    with caplog.at_level(logging.WARNING):
        one_dp_round(DEFAULT_MAX_NOISE_RATIO, 400, 2)
    assert any("z sqrt(d) / n = 10 times" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"= 11 times .* above dp-max-noise-ratio = 10"):
        one_dp_round(DEFAULT_MAX_NOISE_RATIO, 484, 2)
    assert one_dp_round(0.0, 484, 2).rounds_started == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        one_dp_round(DEFAULT_MAX_NOISE_RATIO, 4, 2)  # ratio 1: no warning
    assert not any("z sqrt(d) / n" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="'dp-max-noise-ratio' must be finite and >= 0"):
        DPConfig(1.0, 1.0, max_noise_ratio=-1.0)
