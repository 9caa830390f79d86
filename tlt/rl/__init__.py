"""GRPO with verifiable rewards: the trainer, its math, checkpoints and the `tlt train` command."""

from tlt.rl.config import TrainConfig
from tlt.rl.trainer import GRPOTrainer

__all__ = ["GRPOTrainer", "TrainConfig"]
