"""Epsilon computed independently of fedfields: Flower 1.41's own RdpAccountant, the oracle the
DP tests hold our accountant and the jobs' reported "dp-epsilon" against (`headline_epsilons`;
that its z/2 is the right multiplier is checked against closed forms in tests/test_dp.py)."""

from __future__ import annotations

from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.serverapp import RdpAccountant as FlowerRdpAccountant


def flower_epsilons(
    sampled: int,
    population: int,
    noise_multiplier: float,
    rounds: int,
    delta: float = 1e-5,
    *,
    without_replacement: bool = False,
) -> list[float]:
    """Epsilon at `delta` after each of `rounds` rounds that sample `sampled` of `population`
    clients with noise multiplier z (Poisson sampling, add-or-remove-one neighbours; or, if
    `without_replacement`, sampling without replacement, replace-one neighbours)."""
    relation, method = NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.POISSON
    if without_replacement:
        relation, method = NeighboringRelation.REPLACE_ONE, SamplingMethod.WITHOUT_REPLACEMENT
    accountant = FlowerRdpAccountant(
        PrivacyConfig(
            target_delta=delta,
            population_size=population,
            neighboring_relation=relation,
            sampling_method=method,
        )
    )
    event = GaussianPrivacyEvent(
        noise_multiplier=noise_multiplier, sample_size=sampled, population_size=population
    )
    epsilons = []
    for _ in range(rounds):
        accountant.compose(event)
        epsilons.append(accountant.get_epsilon(delta))
    return epsilons


def headline_epsilons(
    sampled: int, population: int, noise_multiplier: float, rounds: int, delta: float = 1e-5
) -> list[float]:
    """ "dp-epsilon" after each round as Flower accounts it: k of n sampled without
    replacement, replace-one neighbours, where one replaced clipped update moves the sum by up
    to 2C, so the multiplier relative to that sensitivity is z/2."""
    return flower_epsilons(
        sampled, population, noise_multiplier / 2, rounds, delta, without_replacement=True
    )
