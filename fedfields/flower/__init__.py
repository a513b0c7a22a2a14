"""fedfields' reusable Flower layer: strategies, their client halves, the message protocol.

Import these into any Flower 1.41 app; none needs this repository's ServerApp or ClientApp.
Server side: each method of `fedfields.methods` as a Flower strategy (`MethodStrategy`, made
by `method_strategy`): `FedAvg`, `FedProx`, `Scaffold`, `FedNova`, `FedExP`, `FedACG`, the
server optimisers `FedAvgM`, `FedAdam`, `FedYogi`, `FedAdagrad`, and `DecentNeRF`, and
`FedMeNF` (a message-API strategy; `Strategy.from_config(context.run_config, ...)`). Client
side: `received_method`, `received_hooks`, `reply_parts` and `keep_results` (the method a
message names, its client hooks: a loss term, a gradient correction; its reply: the local
state or the method's transform of it, with the records and state they leave),
`answer_gradient_query` (a gradient query's G_k), `DecentNeRFClient` (a user's alpha_k and
its alpha-weighted reply), `meta_train_parts` (FedMeNF's LocalUpdate), `NodeState` (a
node's private state, versioned by `RunAttempt`), `answer_user_key` (the node's answer to
`USER_KEY_ACTION`: which user it is), `secure_aggregation_mod` (Flower SecAgg+ for every
strategy) and `compressed_download_mod` (rebuilds a compressed download's global before the
handler). The `*_parts` functions (`reply_parts`, `gradient_parts`, `meta_train_parts`)
return a reply's records and metrics before it is sent (`protocol.ReplyParts`, whose
`message(msg)` makes the reply), for an app that adds its own.
Record and key names are in `fedfields.flower.protocol` and the methods' modules.
"""

from __future__ import annotations

from fedfields.flower.client_hooks import (
    answer_gradient_query,
    gradient_parts,
    keep_results,
    received_hooks,
    received_method,
    reply_parts,
)
from fedfields.flower.compressed_downloads import compressed_download_mod
from fedfields.flower.decentnerf import DecentNeRFClient
from fedfields.flower.fedmenf import FedMeNF, m_of_n_sampling, meta_train_parts
from fedfields.flower.node import NodeState, RunAttempt, answer_user_key, client_index
from fedfields.flower.protocol import USER_KEY_ACTION
from fedfields.flower.secure_aggregation import secure_aggregation_mod
from fedfields.flower.strategy import (
    EmptyRoundsError,
    InsufficientNodesError,
    MethodOptions,
    MethodStrategy,
    ProtocolStrategy,
    StrategyOptions,
    method_strategy,
)
from fedfields.methods import (
    decentnerf,
    fedacg,
    fedavg,
    fedavgm,
    fedexp,
    fednova,
    fedopt,
    fedprox,
    scaffold,
)

FedAvg = method_strategy(fedavg.FedAvg)
FedProx = method_strategy(fedprox.FedProx)
Scaffold = method_strategy(scaffold.Scaffold)
FedNova = method_strategy(fednova.FedNova)
FedExP = method_strategy(fedexp.FedExP)
FedACG = method_strategy(fedacg.FedACG)
FedAvgM = method_strategy(fedavgm.FedAvgM)
FedAdam = method_strategy(fedopt.FedAdam)
FedYogi = method_strategy(fedopt.FedYogi)
FedAdagrad = method_strategy(fedopt.FedAdagrad)
DecentNeRF = method_strategy(decentnerf.DecentNeRF)

__all__ = [
    "USER_KEY_ACTION",
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
    "MethodOptions",
    "MethodStrategy",
    "NodeState",
    "RunAttempt",
    "ProtocolStrategy",
    "Scaffold",
    "StrategyOptions",
    "answer_gradient_query",
    "answer_user_key",
    "client_index",
    "compressed_download_mod",
    "gradient_parts",
    "keep_results",
    "m_of_n_sampling",
    "meta_train_parts",
    "method_strategy",
    "received_hooks",
    "received_method",
    "reply_parts",
    "secure_aggregation_mod",
]
