"""tlt: lossless, adaptive speculative decoding for the long tail of reasoning-RL rollouts."""

from tlt.errors import CheckpointError, ConfigError, TltError
from tlt.model import KVCache, ModelConfig, ModelOutput, Transformer, load_config, load_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "KVCache", "ModelConfig", "ModelOutput", "TltError", "Transformer",
    "load_config", "load_model",
]
