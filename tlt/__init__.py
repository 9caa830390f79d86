"""tlt: lossless, adaptive speculative decoding for the long tail of reasoning-RL rollouts."""

from tlt.errors import CheckpointError, ConfigError, TltError
from tlt.model import KVCache, ModelConfig, ModelOutput, Transformer, load_config, load_model
from tlt.rollout import Completion, EngineConfig, RequestOutput, RolloutEngine, SamplingParams
from tlt.speculative import Drafter, Strategy
from tlt.tokenizer import load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "Completion", "ConfigError", "Drafter", "EngineConfig", "KVCache", "ModelConfig", "ModelOutput",
    "RequestOutput", "RolloutEngine", "SamplingParams", "Strategy", "TltError", "Transformer", "load_config", "load_model",
    "load_tokenizer",
]
