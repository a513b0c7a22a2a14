"""FedProx (Li et al. 2020, Eq. 2): FedAvg's server step, and each client adds the proximal
term

    h_k(w; w_g) = F_k(w) + mu/2 ||w - w_g||^2

to its local loss, w_g the global it received. The server sends mu as "proximal-mu"; mu = 0
is FedAvg. A method may send its own weight under the same key (a term around a lookahead).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedfields.methods.base import ARRAYS, ClientHook, Kept, Method, State, on_device
from fedfields.methods.settings import (
    MAX_LOSS_WEIGHT,
    StrategySettings,
    setting,
    within,
)

Parameters = Iterable[Tensor] | Mapping[str, Tensor]

PROXIMAL_MU = "proximal-mu"
"""Train-config entry: mu of the clients' proximal term (FedProx's mu, FedACG's beta)."""


@dataclass(frozen=True)
class FedProxSettings(StrategySettings):
    """FedProx's run-config keys."""

    robust_rules = True
    proximal_mu: float = setting(
        0.01,
        "proximal-mu",
        "FedProx mu (scene and meta tasks), at most 1e6",
        within(0.0, MAX_LOSS_WEIGHT),
    )


class FedProx(Method):
    """FedProx's server half: FedAvg's mean, with mu sent to the clients as "proximal-mu".

    Args:
        proximal_mu: weight mu >= 0 of the proximal term (default 0.0, as Flower's FedProx).
    """

    name = "fedprox"
    settings_class = FedProxSettings

    def __init__(self, *, proximal_mu: float = 0.0) -> None:
        if not (math.isfinite(proximal_mu) and proximal_mu >= 0):
            raise ValueError(f"proximal_mu must be non-negative and finite, got {proximal_mu}")
        self.proximal_mu = float(proximal_mu)

    def client_config(self) -> dict[str, int | float | str]:
        """mu as "proximal-mu"."""
        return {PROXIMAL_MU: self.proximal_mu}

    @classmethod
    def client_hooks(
        cls, config: Mapping[str, Any], received: Mapping[str, State], kept: Kept
    ) -> list[ClientHook]:
        """The proximal term around the global received, when "proximal-mu" > 0."""
        return proximal_hooks(config, received)


def proximal_hooks(config: Mapping[str, Any], received: Mapping[str, State]) -> list[ClientHook]:
    """[`ProximalHook`] around the received ARRAYS when the message's "proximal-mu" is
    positive (the clients of any method that sends it), else []."""
    mu = float(config.get(PROXIMAL_MU, 0.0))
    return [ProximalHook(mu, received[ARRAYS])] if mu > 0 else []


class ProximalHook(ClientHook):
    """The client's term mu/2 ||w - w_g||^2 on the trained parameters (Eq. 2), w_g the global
    it received (None: the parameters it starts from)."""

    def __init__(self, mu: float, reference: State | None = None) -> None:
        if not (math.isfinite(mu) and mu >= 0):
            raise ValueError(f"proximal_mu must be >= 0 and finite, got {mu}")
        self.mu = float(mu)
        self.reference = reference
        self.parameters: Mapping[str, Tensor] = {}
        self.device_reference: dict[str, Tensor] = {}

    def key(self) -> tuple[Any, ...]:
        """mu, which a captured step bakes in."""
        return ("proximal", self.mu)

    def bind(self, parameters: Mapping[str, Tensor]) -> None:
        """w_g checked against the parameters, on their device."""
        self.parameters = parameters
        self.device_reference = on_device(self.reference, parameters, "global_reference")

    def loss(self) -> Tensor:
        """mu/2 ||w - w_g||^2."""
        return proximal_term(self.parameters, self.device_reference, self.mu)

    def refill(self, other: ClientHook) -> None:
        """`other`'s w_g into this hook's buffers."""
        assert isinstance(other, ProximalHook)
        reference = on_device(other.reference, self.parameters, "global_reference")
        for name, tensor in self.device_reference.items():
            tensor.copy_(reference[name])


def _aligned(local: Parameters, remote: Parameters) -> list[tuple[str, Tensor, Tensor]]:
    """(name, w, w_g) triples from two dicts with the same keys or two aligned iterables."""
    if isinstance(local, Mapping) and isinstance(remote, Mapping):
        if local.keys() != remote.keys():
            raise ValueError(f"keys differ: local {list(local)}, global {list(remote)}")
        return [(repr(key), local[key], remote[key]) for key in local]
    if isinstance(local, Mapping) or isinstance(remote, Mapping):
        raise ValueError("pass both parameter sets as dicts or both as iterables")
    local, remote = list(local), list(remote)
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local parameters but {len(remote)} global ones")
    return [(str(i), w, g) for i, (w, g) in enumerate(zip(local, remote, strict=True))]


def proximal_term(parameters: Parameters, global_parameters: Parameters, mu: float) -> Tensor:
    """mu/2 * sum ||w - w_g||^2 as a 0-d tensor, differentiable in w (w_g is detached).

    Pass two aligned iterables (e.g. `module.parameters()`) or two dicts with the same keys;
    squares are summed in float64 and the result has the first parameter's dtype.
    """
    mu = float(mu)
    if not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be non-negative and finite, got {mu}")
    triples = _aligned(parameters, global_parameters)
    if not triples:
        raise ValueError("no parameters given")
    squared = []
    for name, w, g in triples:
        if w.shape != g.shape:
            raise ValueError(
                f"parameter {name}: local shape {tuple(w.shape)} != global {tuple(g.shape)}"
            )
        squared.append((w - g.detach().to(w.dtype)).pow(2).sum(dtype=torch.float64))
    return (0.5 * mu * torch.stack(squared).sum()).to(triples[0][1].dtype)
