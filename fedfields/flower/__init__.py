"""fedfields' reusable Flower layer: strategies, their client halves, the message protocol.

Import these into any Flower 1.41 app; none needs this repository's ServerApp or ClientApp.
Server side: `FedAvg`, `FedProx`, `Scaffold`, `FedNova`, `FedExP`, `FedACG`, `DecentNeRF`,
`FedMeNF` and the server optimisers `FedAvgM`, `FedAdam`, `FedYogi`, `FedAdagrad` (message-API
strategies
built on Flower's FedAvg; `Strategy.from_config(context.run_config, ...)`). Client side:
`DecentNeRFClient` (gradient query, alpha, alpha-weighted reply), `ScaffoldClient` (c_i in the
node's state), `meta_train_reply` (FedMeNF's LocalUpdate), `NodeState` (a node's private
state), `secure_aggregation_mod` (Flower SecAgg+ for every strategy) and
`compressed_download_mod` (rebuilds a compressed download's global before the handler). The
`*_parts` variants (`meta_train_parts`, `DecentNeRFClient.train_parts`) return a reply's records and
metrics before it is sent (`protocol.ReplyParts`), for an app that adds its own. Record and key
names are in `fedfields.flower.protocol`.
"""

from __future__ import annotations

from fedfields.flower.decentnerf import DecentNeRF, DecentNeRFClient
from fedfields.flower.downloads import compressed_download_mod
from fedfields.flower.fedacg import FedACG
from fedfields.flower.fedadagrad import FedAdagrad
from fedfields.flower.fedadam import FedAdam
from fedfields.flower.fedavg import FedAvg
from fedfields.flower.fedavgm import FedAvgM
from fedfields.flower.fedexp import FedExP
from fedfields.flower.fedmenf import FedMeNF, m_of_n_sampling, meta_train_parts, meta_train_reply
from fedfields.flower.fednova import FedNova
from fedfields.flower.fedprox import FedProx
from fedfields.flower.fedyogi import FedYogi
from fedfields.flower.node import NodeState, client_index
from fedfields.flower.round_loop import EmptyRoundsError
from fedfields.flower.sampling import InsufficientNodesError
from fedfields.flower.scaffold import Scaffold, ScaffoldClient
from fedfields.flower.secure_aggregation import secure_aggregation_mod
from fedfields.flower.strategy import ProtocolStrategy
from fedfields.flower.strategy_options import StrategyOptions

__all__ = [
    "DecentNeRF",
    "DecentNeRFClient",
    "EmptyRoundsError",
    "FedACG",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedExP",
    "FedMeNF",
    "FedNova",
    "FedProx",
    "FedYogi",
    "InsufficientNodesError",
    "NodeState",
    "ProtocolStrategy",
    "Scaffold",
    "ScaffoldClient",
    "StrategyOptions",
    "client_index",
    "compressed_download_mod",
    "m_of_n_sampling",
    "meta_train_parts",
    "meta_train_reply",
    "secure_aggregation_mod",
]
