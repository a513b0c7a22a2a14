"""The privacy loss of client-level DP rounds: charges, epsilon, and the plan a run may spend.

A round samples a fixed k of the n connected clients without replacement, so the figure a run
reports and `dp-target-epsilon` holds to (`EPSILON_METRIC`) is the bound for that sampling:
Renyi DP under replace-one neighbours (n is public; one client's data is swapped for
another's), where replacing one clipped update moves the sum by up to 2C, so each round is
the without-replacement subsampled Gaussian of multiplier z/2 (Wang, Balle and Kasiviswanathan
2019, Theorem 27), composed with Google's dp-accounting. Beside it, as assumptions the runs do
not meet: the same rounds as Poisson-subsampled Gaussians under add-or-remove-one neighbours
(what Flower's `RdpAccountant` reports; `EPSILON_POISSON_METRIC`) and their PLD figure.
`check_plan` refuses a run whose planned rounds would exceed dp-target-epsilon. The mechanism
(clipping, noise) is `fedfields.privacy.dp`.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fedfields.privacy.dp import DELTA_KEY, NOISE_MULTIPLIER_KEY, TARGET_EPSILON_KEY, DPConfig

EPSILON_METRIC = "dp-epsilon"
"""Metric (metrics.jsonl, summary.json's final): epsilon at dp-delta the run has spent, for
what runs (k of n sampled without replacement, replace-one neighbours, Renyi DP): the figure
dp-target-epsilon holds to."""
EPSILON_POISSON_METRIC = "dp-epsilon-poisson"
"""Metric: the same rounds' epsilon were they Poisson-sampled with q = k/n (add-or-remove-one
neighbours, Renyi DP; Flower's `RdpAccountant`): an assumption the runs do not meet."""
EPSILON_PLD_METRIC = "dp-epsilon-poisson-pld"
"""Metric: the Poisson rounds' epsilon through the PLD accountant (tighter than RDP)."""
WOR_DENOMINATOR = 1 << 20
"""A round charged by its rate q alone (a plan, or a charge from before k and n were kept) is
accounted as k of n with k/n the nearest fraction to q of denominator at most this: the
without-replacement bound depends on q = k/n only."""
PLD_INTERVAL = 1e-2
"""dp-accounting's PLD value discretisation: pessimistic, so still an upper bound, a little
above the default 1e-4's epsilon and far faster (docs/PRIVACY.md gives the figures)."""
PLD_MIN_MULTIPLIER = 0.5
"""Below this noise multiplier the PLD figure is left out: its privacy loss spans too wide a
range to discretise in seconds (and epsilon is in the hundreds, RDP says as much)."""
MAX_ROUNDS = 1 << 40
"""`rounds_within` stops counting here: a plan this long is never the binding constraint."""


@dataclass(frozen=True)
class RoundCharge:
    """One round as the accountant sees it: the rate q = k/n of clients sampled, noise
    multiplier z (the effective one where dropouts lowered it), and, when known, the k
    clients sampled of the n connected (0, 0: a plan, or a charge from before they were
    kept; accounted as the nearest fraction to q)."""

    sampling_rate: float
    noise_multiplier: float
    sampled: int = 0
    population: int = 0

    def __post_init__(self) -> None:
        q, z = self.sampling_rate, self.noise_multiplier
        if isinstance(q, bool) or not (math.isfinite(q) and 0.0 <= q <= 1.0):
            raise ValueError(f"sampling rate must be in [0, 1], got {q!r}")
        if isinstance(z, bool) or not (math.isfinite(z) and z >= 0.0):
            raise ValueError(f"noise multiplier must be finite and >= 0, got {z!r}")
        k, n = self.sampled, self.population
        if not (isinstance(k, int) and isinstance(n, int) and 0 <= k <= n):
            raise ValueError(f"sampled and population must be integers 0 <= k <= n, got {k}, {n}")

    @property
    def counted(self) -> bool:
        """Whether the round's k of n are known (else q stands for them)."""
        return self.population > 0


def _check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not (math.isfinite(delta) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def _rdp_accountant(orders: Sequence[float] | None) -> Any:
    """A fresh dp-accounting RDP accountant for the headline bound (replace-one neighbours)."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    orders = None if orders is None else list(orders)
    return RdpAccountant(orders=orders, neighboring_relation=NeighboringRelation.REPLACE_ONE)


def _sizes(charge: RoundCharge) -> tuple[int, int]:
    """(n, k) of a round: its counts when known, else the nearest fraction to its rate."""
    if charge.counted:
        return charge.population, charge.sampled
    rate = Fraction(charge.sampling_rate).limit_denominator(WOR_DENOMINATOR)
    return rate.denominator, rate.numerator


def _compose(accountant: Any, charge: RoundCharge, count: int) -> None:
    """Compose `count` rounds of `charge` as k of n sampled without replacement, each a
    Gaussian of multiplier z/2 under replace-one neighbours (sensitivity 2C)."""
    from dp_accounting import dp_event

    population, sampled = _sizes(charge)
    if sampled == 0:  # nobody's data was touched: free
        return
    gaussian = dp_event.GaussianDpEvent(charge.noise_multiplier / 2)
    if charge.noise_multiplier == 0:  # dp-accounting divides by z here; no noise: unbounded
        _quiet_compose(accountant, gaussian, count)
        return
    event = dp_event.SampledWithoutReplacementDpEvent(population, sampled, gaussian)
    _quiet_compose(accountant, event, count)


def _compose_poisson(accountant: Any, charge: RoundCharge, count: int) -> None:
    """Compose `count` rounds of `charge` as Poisson-subsampled Gaussian mechanisms.

    dp-accounting logs a warning for each fractional order whose series does not converge
    (q >= ~0.25) and leaves that order out, which can only raise epsilon; the warnings are
    kept out of the run's log.
    """
    from dp_accounting import dp_event

    gaussian = dp_event.GaussianDpEvent(charge.noise_multiplier)
    event = dp_event.PoissonSampledDpEvent(charge.sampling_rate, gaussian)
    _quiet_compose(accountant, event, count)


def _quiet_compose(accountant: Any, event: Any, count: int) -> None:
    """`accountant.compose(event, count)` without dp-accounting's per-order warnings."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        accountant.compose(event, count)
    finally:
        absl_logger.setLevel(level)


def epsilon_pld(charges: Iterable[RoundCharge], delta: float) -> float | None:
    """Epsilon at `delta` of the Poisson-subsampled rounds through dp-accounting's PLD
    accountant (pessimistic estimate, discretisation `PLD_INTERVAL`); 0 for no rounds, inf
    for a sampled round without noise, None below `PLD_MIN_MULTIPLIER` or where dp-accounting
    cannot discretise the loss."""
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    delta = _check_delta(delta)
    accountant = PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    for charge, count in Counter(charges).items():
        if charge.sampling_rate == 0:
            continue
        if charge.noise_multiplier == 0:
            return math.inf
        if charge.noise_multiplier < PLD_MIN_MULTIPLIER:
            return None
        gaussian = dp_event.GaussianDpEvent(charge.noise_multiplier)
        event = dp_event.PoissonSampledDpEvent(charge.sampling_rate, gaussian)
        try:
            _quiet_compose(accountant, event, count)
        except (ValueError, MemoryError):
            return None
    return float(accountant.get_epsilon(delta))


def epsilon_poisson(
    charges: Iterable[RoundCharge], delta: float, orders: Sequence[float] | None = None
) -> float:
    """Epsilon at `delta` of the rounds were they Poisson-sampled with q = k/n (Renyi DP,
    add-or-remove-one client): an assumption, reported beside the headline figure."""
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant(orders=None if orders is None else list(orders))
    for charge, count in Counter(charges).items():
        _compose_poisson(accountant, charge, count)
    return float(accountant.get_epsilon(_check_delta(delta)))


def epsilon_of(
    charges: Iterable[RoundCharge], delta: float, orders: Sequence[float] | None = None
) -> float:
    """Epsilon at `delta` of the composed rounds as they run: k of n sampled without
    replacement, replace-one neighbours (dp-accounting's default orders unless `orders` is
    given). inf when a sampled round had no noise; 0 for no rounds."""
    accountant = _rdp_accountant(orders)
    for charge, count in Counter(charges).items():
        _compose(accountant, charge, count)
    return float(accountant.get_epsilon(_check_delta(delta)))


def rounds_within(
    target_epsilon: float,
    sampling_rate: float,
    noise_multiplier: float,
    delta: float,
    spent: Iterable[RoundCharge] = (),
    orders: Sequence[float] | None = None,
) -> int:
    """How many more rounds of (q, z) keep epsilon at `delta` <= `target_epsilon` after the
    rounds already `spent` (at most MAX_ROUNDS). A plan of more rounds cannot meet it."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target epsilon must be finite and > 0, got {target_epsilon!r}")
    charge = RoundCharge(sampling_rate, noise_multiplier)
    _check_delta(delta)
    base = _rdp_accountant(orders)
    for previous, count in Counter(spent).items():
        _compose(base, previous, count)
    return _rounds_within(base, target_epsilon, charge, delta)


def _rounds_within(base: Any, target_epsilon: float, charge: RoundCharge, delta: float) -> int:
    """Largest R <= MAX_ROUNDS with epsilon(base + R x charge) <= target (epsilon grows with
    R): doubling, then bisection, each probe one composition with a count."""

    def fits(rounds: int) -> bool:
        probe = copy.deepcopy(base)
        _compose(probe, charge, rounds)
        return float(probe.get_epsilon(delta)) <= target_epsilon

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        if high == MAX_ROUNDS:
            return MAX_ROUNDS
        low, high = high, min(2 * high, MAX_ROUNDS)
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


class DPAccountant:
    """The privacy loss of a run so far: one charge (q, z) per aggregated round, epsilon at
    `delta` after each; `state_dict` / `from_state_dict` carry it across a resume."""

    def __init__(
        self,
        delta: float,
        charges: Iterable[RoundCharge] = (),
        orders: Sequence[float] | None = None,
    ) -> None:
        self.delta = _check_delta(delta)
        self.orders = None if orders is None else tuple(float(order) for order in orders)
        self._charges = list(charges)
        self._backend = _rdp_accountant(self.orders)
        for charge, count in Counter(self._charges).items():
            _compose(self._backend, charge, count)

    @property
    def charges(self) -> tuple[RoundCharge, ...]:
        """The rounds charged so far, in order."""
        return tuple(self._charges)

    def charge(
        self, sampling_rate: float, noise_multiplier: float, sampled: int = 0, population: int = 0
    ) -> float:
        """Charge one round of sampling rate q and noise multiplier z (with its k sampled of
        n connected when known); epsilon afterwards."""
        charge = RoundCharge(sampling_rate, noise_multiplier, sampled, population)
        _compose(self._backend, charge, 1)
        self._charges.append(charge)
        return self.epsilon()

    def epsilon(self) -> float:
        """Epsilon at `delta` spent by the rounds charged so far."""
        return float(self._backend.get_epsilon(self.delta))

    def report(self) -> dict[str, float]:
        """Epsilon three ways: the headline (`EPSILON_METRIC`, k of n without replacement,
        what the target holds to), and as assumptions Poisson RDP and Poisson PLD (unless
        dp-accounting cannot discretise it)."""
        report = {
            EPSILON_METRIC: self.epsilon(),
            EPSILON_POISSON_METRIC: epsilon_poisson(self._charges, self.delta),
        }
        pld = epsilon_pld(self._charges, self.delta)
        return report if pld is None else {**report, EPSILON_PLD_METRIC: pld}

    def epsilon_after(
        self,
        sampling_rate: float,
        noise_multiplier: float,
        rounds: int = 1,
        sampled: int = 0,
        population: int = 0,
    ) -> float:
        """Epsilon if `rounds` more rounds of (q, z) (k of n when given) were charged;
        charges nothing."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        probe = copy.deepcopy(self._backend)
        charge = RoundCharge(sampling_rate, noise_multiplier, sampled, population)
        _compose(probe, charge, rounds)
        return float(probe.get_epsilon(self.delta))

    def rounds_left(
        self, target_epsilon: float, sampling_rate: float, noise_multiplier: float
    ) -> int:
        """How many more rounds of (q, z) keep epsilon <= `target_epsilon`."""
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target epsilon must be finite and > 0, got {target_epsilon!r}")
        charge = RoundCharge(sampling_rate, noise_multiplier)
        return _rounds_within(self._backend, target_epsilon, charge, self.delta)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: delta, orders and the (q, z, k, n) of every charged round
        (a state of (q, z) pairs, from before k and n were kept, still loads)."""
        return {
            "delta": self.delta,
            "orders": None if self.orders is None else list(self.orders),
            "charges": [
                [c.sampling_rate, c.noise_multiplier, c.sampled, c.population]
                for c in self._charges
            ],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DPAccountant:
        """The accountant `state_dict` saved; ValueError naming what is malformed."""
        try:
            charges = [
                RoundCharge(float(q), float(z), *(int(count) for count in counts))
                for q, z, *counts in state["charges"]
            ]
            return cls(float(state["delta"]), charges, state.get("orders"))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"DP accountant state is malformed: {error}") from None


def check_plan(config: DPConfig, charges: Sequence[RoundCharge]) -> float:
    """The planned rounds' epsilon at `config.delta`; ValueError naming dp-target-epsilon when
    it exceeds a set target (a plan that cannot meet it is refused before it starts)."""
    epsilon = epsilon_of(charges, config.delta)
    if config.target_epsilon > 0 and epsilon > config.target_epsilon:
        raise ValueError(
            f"'{TARGET_EPSILON_KEY}' = {config.target_epsilon:g} cannot be met: {len(charges)} "
            f"rounds (sampling rate {charges[-1].sampling_rate:.4g} ahead) with "
            f"'{NOISE_MULTIPLIER_KEY}' = {config.noise_multiplier:g} spend epsilon "
            f"{epsilon:.4g} at '{DELTA_KEY}' = {config.delta:g}; raise the noise, sample "
            "fewer clients or plan fewer rounds"
        )
    return epsilon
