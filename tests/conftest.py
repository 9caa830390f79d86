import json
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TLT_TEST_THREADS", "1")))


def tiny_hf_model(arch: str = "qwen2", seed: int = 0, **overrides):
    """A randomly initialised transformers model; every parameter (biases and norms too) is random so
    no code path is hidden behind a zero or a one."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    kinds = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, head_dim=16,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    base.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(kinds[arch](**base)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    return model


def edit_config(folder: Path, **changes) -> Path:
    """Rewrite config.json with `changes` applied; a value of None deletes the field."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture
def hf_folder(tmp_path):
    """Factory: save a tiny transformers model and return (hf_model, folder)."""

    def make(arch: str = "qwen2", seed: int = 0, **overrides):
        model = tiny_hf_model(arch, seed, **overrides)
        folder = tmp_path / f"{arch}-{seed}-{len(list(tmp_path.iterdir()))}"
        model.save_pretrained(folder)
        return model, folder

    return make


@pytest.fixture
def tiny_model():
    """A random tlt model built directly (no transformers), fp32."""
    from tlt.model import ModelConfig, Transformer

    def make(seed: int = 0, **overrides):
        fields = dict(
            architecture="Qwen3ForCausalLM", vocab_size=61, hidden_size=48, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            max_position_embeddings=256, qk_norm=True,
        )
        fields.update(overrides)
        torch.manual_seed(seed)
        from random_weights import randomize_

        return randomize_(Transformer(ModelConfig(**fields)).eval(), 0.1)

    return make


@pytest.fixture
def script():
    """Loads scripts/NAME.py as a module (the scripts are not part of the package)."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
