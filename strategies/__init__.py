"""Flower strategies (message API) built on ``fedfields.aggregate``.

Each speaks the protocol of ``fedfields.flower_io`` and runs standalone under any Flower
1.41 ServerApp: ``strategy.start(grid, initial_arrays, num_rounds, train_config=...)``.
"""

from __future__ import annotations

from strategies.base import ProtocolStrategy, StrategyOptions
from strategies.decentnerf import DecentNeRF
from strategies.fedavg import FedAvg
from strategies.fedmenf import FedMeNF, m_of_n_sampling
from strategies.fedprox import FedProx
from strategies.scaffold import Scaffold

__all__ = [
    "DecentNeRF",
    "FedAvg",
    "FedMeNF",
    "FedProx",
    "ProtocolStrategy",
    "Scaffold",
    "StrategyOptions",
    "m_of_n_sampling",
]
