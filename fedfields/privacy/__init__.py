"""Privacy machinery: secure-sum planning for Flower SecAgg+, split learning and its defences.

Pure PyTorch; the Flower glue lives in strategies/ and clients/.
"""

from fedfields.privacy.defences import ClientDefence, NoisyLabel, S2NeRFNoise
from fedfields.privacy.secagg_plan import (
    SecureAggregationConfig,
    SecureAggregationError,
    payload_layout,
)
from fedfields.privacy.split import (
    ClientPart,
    ClientStepResult,
    RaySamples,
    ServerPart,
    SplitExchange,
    SplitResult,
    SplitTrainConfig,
    client_step,
    render_embeddings,
    sample_rays,
    server_backward,
    server_forward,
    split_field,
    train_split,
)

__all__ = [
    "ClientDefence",
    "ClientPart",
    "ClientStepResult",
    "NoisyLabel",
    "RaySamples",
    "S2NeRFNoise",
    "SecureAggregationConfig",
    "SecureAggregationError",
    "ServerPart",
    "SplitExchange",
    "SplitResult",
    "SplitTrainConfig",
    "client_step",
    "payload_layout",
    "render_embeddings",
    "sample_rays",
    "server_backward",
    "server_forward",
    "split_field",
    "train_split",
]
