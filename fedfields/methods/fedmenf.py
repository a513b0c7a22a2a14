"""FedMeNF's meta-aggregation (FedMeNF paper, Algorithm 1, Eq. 2): the server of federated
meta-learning takes the size-weighted mean of the M sampled clients' local meta-learners,

    theta <- sum_m |D_m| w_m / sum_m |D_m|,

|D_m| the reply's "num-examples" (the client's dataset size): FedAvg's step, which a robust
rule may replace. What makes it FedMeNF is the clients' privacy-preserving local loss
(`fedfields.train.meta`, Eq. 10-14), chosen by run-config `meta-learner`, not the
aggregation; the M of N sampling is the strategy's (`m_of_n_sampling` in the Flower layer).
"""

from __future__ import annotations

from fedfields.methods.fedavg import FedAvg


class FedMeNF(FedAvg):
    """FedMeNF's server step: FedAvg's, the size-weighted mean as it is (no key of its own)."""

    name = "fedmenf"
