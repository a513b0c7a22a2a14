"""Training loops: centralised reference, a federated client's local round, meta-learning
(MAML, FOMAML, Reptile, FedMeNF), evaluation."""

from fedfields.train.centralised import (
    Setup,
    TrainConfig,
    TrainResult,
    default_setup,
    learning_rate_factor,
    train,
)
from fedfields.train.checkpoint import load_checkpoint, save_checkpoint
from fedfields.train.evaluation import Evaluation, evaluate, write_renders
from fedfields.train.federated import (
    LocalTrainConfig,
    LocalTrainResult,
    federated_state,
    load_federated_state,
    local_train,
    loss_gradient,
)
from fedfields.train.meta import (
    MetaConfig,
    MetaUpdateResult,
    adaptive_gamma,
    local_meta_update,
    privacy_metrics,
    test_time_optimise,
)
from fedfields.train.meta_tasks import CoordinateTask, MetaTask, RayTask, coordinate_tasks

__all__ = [
    "CoordinateTask",
    "Evaluation",
    "LocalTrainConfig",
    "LocalTrainResult",
    "MetaConfig",
    "MetaTask",
    "MetaUpdateResult",
    "RayTask",
    "Setup",
    "TrainConfig",
    "TrainResult",
    "adaptive_gamma",
    "coordinate_tasks",
    "default_setup",
    "evaluate",
    "federated_state",
    "learning_rate_factor",
    "load_checkpoint",
    "load_federated_state",
    "local_meta_update",
    "local_train",
    "loss_gradient",
    "privacy_metrics",
    "save_checkpoint",
    "test_time_optimise",
    "train",
    "write_renders",
]
