"""Pure aggregation maths over state dicts: FedAvg, FedProx, Scaffold, FedNova, FedExP, FedACG,
DecentNeRF, robust rules (coordinate-wise median, trimmed mean), running sums and costs."""

from __future__ import annotations

from fedfields.methods.accounting import (
    DECENTNERF_COST,
    DECENTNERF_PAPER_COST,
    FEDAVG_COST,
    CostModel,
    RoundCost,
    centralised_cost,
    secagg_reconstruction_flops,
)
from fedfields.methods.base import RunningSum
from fedfields.methods.decentnerf import (
    ALPHA_KEY,
    alpha_gradient,
    alpha_update,
    alpha_weighted_payload,
    decentnerf_aggregate,
)
from fedfields.methods.fedacg import fedacg_lookahead, fedacg_update
from fedfields.methods.fedexp import FedExPSums
from fedfields.methods.fednova import FedNovaSums
from fedfields.methods.fedprox import proximal_term
from fedfields.methods.robust import (
    AGGREGATION_RULES,
    coordinate_median,
    coordinate_trimmed_mean,
    robust_aggregate,
)
from fedfields.methods.scaffold import (
    SCAFFOLD_COST,
    scaffold_corrected_gradient,
    scaffold_server_update_from_sums,
)

__all__ = [
    "AGGREGATION_RULES",
    "ALPHA_KEY",
    "DECENTNERF_COST",
    "DECENTNERF_PAPER_COST",
    "FEDAVG_COST",
    "SCAFFOLD_COST",
    "CostModel",
    "FedExPSums",
    "FedNovaSums",
    "RoundCost",
    "RunningSum",
    "alpha_gradient",
    "alpha_update",
    "alpha_weighted_payload",
    "centralised_cost",
    "coordinate_median",
    "coordinate_trimmed_mean",
    "fedacg_lookahead",
    "fedacg_update",
    "decentnerf_aggregate",
    "proximal_term",
    "robust_aggregate",
    "scaffold_corrected_gradient",
    "scaffold_server_update_from_sums",
    "secagg_reconstruction_flops",
]
