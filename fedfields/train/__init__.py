"""Training loops: centralised reference training, evaluation and checkpoints."""

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

__all__ = [
    "Evaluation",
    "PixelSampler",
    "Setup",
    "TrainConfig",
    "TrainResult",
    "default_setup",
    "evaluate",
    "learning_rate_factor",
    "load_checkpoint",
    "resolve_device",
    "save_checkpoint",
    "train",
    "write_renders",
]
