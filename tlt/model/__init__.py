"""The Llama-family model: configuration, RoPE, KV cache, the transformer and checkpoint I/O."""

from tlt.model.checkpoint import load_config, load_model, save_pretrained
from tlt.model.config import ModelConfig
from tlt.model.kv_cache import KVCache
from tlt.model.transformer import ModelOutput, Transformer

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "Transformer", "load_config", "load_model", "save_pretrained"]
