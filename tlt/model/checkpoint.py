"""Loading and saving Hugging Face model folders.

A folder holds `config.json` and the weights as `model.safetensors` or as shards listed in
`model.safetensors.index.json` (its `weight_map` maps tensor names to shard files). Generation stops on
the eos ids of `config.json` and of `generation_config.json` together: chat models often declare their
end-of-turn token only in the latter, and transformers' `generate` stops on it, so a rollout must
too. Built-in names (`default`) resolve to folders shipped inside the package. Every failure names the
file and the field or tensor at fault; every file is written atomically (temporary file, then
rename), so an interrupted save never leaves a torn checkpoint behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tlt.errors import CheckpointError, ConfigError
from tlt.io import atomic_write_bytes, atomic_write_json
from tlt.model.config import ModelConfig
from tlt.model.transformer import Transformer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN_MODELS = {"default": ASSETS / "default"}

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the spellings options and config fields offer
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_model_path(path_or_name: str | os.PathLike) -> Path:
    name = str(path_or_name)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    if name == "bench":  # built by `make bench-model` into a cache folder (tlt/bench_model.py)
        from tlt.bench_model import model_folder

        return model_folder()
    path = Path(name)
    if path.is_file():
        raise CheckpointError(f"{path}: is a file; expected a model folder holding config.json and the weights")
    if not path.is_dir():
        raise CheckpointError(
            f"no model folder at {name!r} and no built-in model of that name (built-ins: {sorted(BUILTIN_MODELS)})"
        )
    return path


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: line {exc.lineno}, column {exc.colno}: invalid JSON ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return data


def load_config(path_or_name: str | os.PathLike) -> ModelConfig:
    path = resolve_model_path(path_or_name) / "config.json"
    return ModelConfig.from_hf_dict(read_json(path), source=str(path))


def generation_eos(folder: Path) -> list[int]:
    """The eos ids of the folder's `generation_config.json` (an int or a list); [] when it has none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: field 'eos_token_id' must be a token id or a list of token ids, got {eos!r}")
    return ids


def parse_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        stored = config.extra.get("dtype") or config.extra.get("torch_dtype") or "float32"
        return DTYPES.get(stored, torch.float32)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def _weight_files(folder: Path) -> dict[str, Path]:
    """Map tensor name -> file holding it (only for sharded checkpoints; {} means one file)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return {}
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: field 'weight_map' is missing or not an object")
    return {name: folder / shard for name, shard in weight_map.items()}


def _missing_weights_hint(folder: Path) -> str:
    """What the folder holds instead of model.safetensors, and what to do about it ("" when nothing)."""
    shards = sorted(f.name for f in folder.glob("*.safetensors"))
    if shards:
        return f"; found {shards[:3]} but no model.safetensors.index.json mapping tensors to them"
    # weights only: a Trainer's output folder also holds training_args.bin
    bins = sorted(f.name for f in folder.glob("pytorch_model*.bin"))
    if bins:
        return (f"; found {bins[:3]}: tlt reads safetensors only (resave the folder with transformers' "
                "save_pretrained, which writes safetensors)")
    return ""


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    shards = _weight_files(folder)
    files = sorted(set(shards.values())) if shards else [folder / "model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            hint = " (listed in model.safetensors.index.json)" if shards else _missing_weights_hint(folder)
            raise CheckpointError(f"{f}: weights file is missing{hint}")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{f}: cannot read safetensors weights ({exc})") from None
    return tensors


def load_model(
    path_or_name: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Transformer:
    """Load a Hugging Face folder (Llama, Qwen2, Qwen3) or a built-in model by name. dtype: None is
    float32, 'auto' is the dtype recorded in config.json. The model's `config.eos_token_id` lists the
    eos ids of config.json followed by those only generation_config.json declares."""
    folder = resolve_model_path(path_or_name)
    config = load_config(folder)
    extra_eos = [i for i in generation_eos(folder) if i not in config.eos_token_ids]
    if extra_eos:
        config = config.replace(eos_token_id=config.eos_token_ids + extra_eos)
    target = parse_dtype(dtype, config)
    with torch.device("meta"):
        model = Transformer(config)
    # Older checkpoints saved each attention's rotary frequencies; they are recomputed from config.json
    # here, as transformers does, which ignores them too.
    tensors = {k: v for k, v in read_tensors(folder).items() if not k.endswith("rotary_emb.inv_freq")}
    expected = model.state_dict()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    where = folder / ("model.safetensors.index.json" if _weight_files(folder) else "model.safetensors")
    missing = [k for k in expected if k not in tensors and not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{where}: tensors missing for this config: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: tensors this {config.architecture} config does not use: {unexpected[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies {tuple(expected[name].shape)}"
            )
    # The meta-device model takes the loaded tensors as its parameters (assign=True), each moved to the
    # device here: one copy of the weights on the device, never an empty model beside them.
    device = torch.device(device or "cpu")
    model.load_state_dict({k: v.to(device=device, dtype=target) for k, v in tensors.items()}, strict=False, assign=True)
    model.to(dtype=target)  # also lays the loaded weights out (`ColumnMajorLinears`)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers are not in the checkpoint; meta-device init left them empty.
    from tlt.model.rope import inverse_frequencies

    inv_freq, _ = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    model.inv_freq = inv_freq.to(model.device)
    model.eval()
    return model


def save_pretrained(model: Transformer, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write a folder transformers can load (`AutoModelForCausalLM.from_pretrained(directory)`)."""
    from safetensors.torch import save

    folder = Path(directory)
    config = model.config
    dtype = dtype or model.dtype
    tensors = {
        k: v.detach().to(dtype).contiguous().cpu()
        for k, v in model.state_dict().items()
        if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    hf = config.to_hf_dict()
    hf["dtype"] = str(dtype).removeprefix("torch.")
    atomic_write_bytes(folder / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    generation = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    atomic_write_json(folder / "generation_config.json", generation)
    atomic_write_json(folder / "config.json", hf)
