"""Training loops: centralised reference, a federated client's local round, evaluation."""

from fedfields.train.centralised import (
    PixelSampler,
    Setup,
    TrainConfig,
    TrainResult,
    default_setup,
    learning_rate_factor,
    resolve_device,
    train,
)
from fedfields.train.checkpoint import load_checkpoint, save_checkpoint
from fedfields.train.evaluation import Evaluation, evaluate, write_renders
from fedfields.train.federated import (
    LocalTrainConfig,
    LocalTrainResult,
    ScaffoldControls,
    federated_state,
    load_federated_state,
    local_train,
    loss_gradient,
)

__all__ = [
    "Evaluation",
    "LocalTrainConfig",
    "LocalTrainResult",
    "PixelSampler",
    "ScaffoldControls",
    "Setup",
    "TrainConfig",
    "TrainResult",
    "default_setup",
    "evaluate",
    "federated_state",
    "learning_rate_factor",
    "load_checkpoint",
    "load_federated_state",
    "local_train",
    "loss_gradient",
    "resolve_device",
    "save_checkpoint",
    "train",
    "write_renders",
]
