"""The tiny GRPO setup several test modules share: a 2-layer character-vocabulary model folder and a
config that runs a step in a fraction of a second."""

import torch

from tlt.config import flatten, override
from tlt.rl import TrainConfig


def save_tiny_policy(folder, **overrides):
    """A random 2-layer Qwen3-style model with the character tokenizer, saved as a model folder;
    `overrides` are ModelConfig fields (another size)."""
    from tlt.model import ModelConfig, Transformer
    from tlt.tasks import CharTokenizer

    torch.manual_seed(0)
    fields = dict(architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  max_position_embeddings=256, qk_norm=True, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    Transformer(ModelConfig(**{**fields, **overrides})).save_pretrained(folder)
    CharTokenizer().save_pretrained(folder)
    return folder


def tiny_config(model_dir, **overrides) -> TrainConfig:
    """`overrides` are TrainConfig fields, a group's as a dict of its keys: drafter={"train": "every"}."""
    fields = {"model": str(model_dir), "drafter.model": None, "speculative": "off", "workers": 1,
              "reward": "reward_fixtures:digit_fraction", "train_problems": 64, "prompts_per_step": 4, "group_size": 4,
              "max_response_tokens": 12, "eval.problems": 4, "eval.samples": 2, "eval.every": 0, "save_every": 0,
              "optim.lr": 1e-2, "steps": 3}
    return override(TrainConfig(), {**fields, **flatten(overrides)})
