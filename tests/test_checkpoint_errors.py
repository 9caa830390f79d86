"""Bad checkpoints fail with a tlt error whose message names the file and the field or tensor at fault."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tlt
from conftest import edit_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def folder(hf_folder):
    """A loadable tiny Qwen3 folder that each test then damages."""
    return hf_folder("qwen3")[1]


def test_path_that_is_neither_folder_nor_builtin(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(tlt.CheckpointError, match=re.escape(repr(str(missing)))) as info:
        tlt.load_model(missing)
    assert "built-in" in str(info.value) and "default" in str(info.value)


def test_file_given_instead_of_folder(folder):
    with pytest.raises(tlt.CheckpointError, match="is a file; expected a model folder"):
        tlt.load_model(folder / "config.json")


def test_folder_without_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(tlt.CheckpointError, match=re.escape(f"{folder / 'config.json'}: file is missing")):
        tlt.load_model(folder)


def test_invalid_json_names_file_and_line(folder):
    (folder / "config.json").write_text('{\n  "hidden_size": 64,\n  "vocab_size": ,\n}\n')
    with pytest.raises(tlt.CheckpointError) as info:
        tlt.load_model(folder)
    message = str(info.value)
    assert message.startswith(f"{folder / 'config.json'}: line 3,")
    assert "invalid JSON" in message


def test_binary_config_is_a_checkpoint_error(folder):
    (folder / "config.json").write_bytes(b"\xff\xfe\x00\x01garbage")
    with pytest.raises(tlt.CheckpointError, match="config.json: not a UTF-8 text file"):
        tlt.load_model(folder)


def test_unsupported_architecture_names_the_value(folder):
    path = edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(tlt.ConfigError) as info:
        tlt.load_model(folder)
    message = str(info.value)
    assert message.startswith(f"{path}:")
    assert "'GPT2LMHeadModel'" in message and "Qwen3ForCausalLM" in message


def test_architectures_must_be_a_list(folder):
    """A bare string used to be indexed, so the error named the architecture 'Q'."""
    edit_config(folder, architectures="Qwen3ForCausalLM")
    with pytest.raises(tlt.ConfigError, match="field 'architectures' must be a list of class names"):
        tlt.load_model(folder)


def test_missing_required_field_names_file_and_field(folder):
    path = edit_config(folder, hidden_size=None)
    with pytest.raises(tlt.ConfigError, match=re.escape(f"{path}: required field 'hidden_size' is missing")):
        tlt.load_model(folder)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(num_attention_heads=0, head_dim=None), "num_attention_heads"),  # used to divide by zero
        (dict(hidden_size="64", head_dim=None), "hidden_size"),  # used to raise a bare TypeError
        (dict(num_hidden_layers=2.0), "num_hidden_layers"),
    ],
)
def test_non_positive_integer_field(folder, changes, field):
    path = edit_config(folder, **changes)
    with pytest.raises(tlt.ConfigError, match=re.escape(f"{path}: field {field!r} must be a positive integer")):
        tlt.load_model(folder)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(rms_norm_eps="1e-6"), "field 'rms_norm_eps' must be a number"),
        (dict(rope_parameters={"rope_theta": "big", "rope_type": "default"}), "field 'rope_theta' must be a number"),
        (dict(rope_parameters=[10000.0]), "field 'rope_parameters' must be an object"),
        (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "ntk"}), "rope_type 'ntk' is not supported"),
    ],
)
def test_bad_value_names_file_and_field(folder, changes, message):
    path = edit_config(folder, **changes)
    with pytest.raises(tlt.ConfigError, match=re.escape(f"{path}: {message}")):
        tlt.load_model(folder)


def test_missing_weights_file(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(tlt.CheckpointError, match=re.escape(f"{folder / 'model.safetensors'}: weights file is missing")):
        tlt.load_model(folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_weights_file_names_the_file(folder, damage):
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x07not a checkpoint" * 64, "empty": b""}[damage])
    with pytest.raises(tlt.CheckpointError, match=re.escape(f"{weights}: cannot read safetensors weights")):
        tlt.load_model(folder)


def test_tensor_with_wrong_shape(folder):
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = torch.zeros(3, 7)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(tlt.CheckpointError) as info:
        tlt.load_model(folder)
    message = str(info.value)
    assert message.startswith(f"{weights}:")
    assert repr(name) in message and "(3, 7)" in message and "(128, 64)" in message


def test_missing_tensor_is_named(folder):
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.norm.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(tlt.CheckpointError, match=re.escape(f"{weights}: tensors missing for this config: ['model.norm.weight']")):
        tlt.load_model(folder)


def test_index_pointing_to_missing_shard(tmp_path):
    from conftest import tiny_hf_model

    tiny_hf_model("llama", hidden_size=128, intermediate_size=256).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(tlt.CheckpointError) as info:
        tlt.load_model(tmp_path)
    assert str(info.value) == f"{tmp_path / shard}: weights file is missing (listed in model.safetensors.index.json)"


def test_invalid_dtype(folder):
    with pytest.raises(tlt.ConfigError) as info:
        tlt.load_model(folder, dtype="float64x")
    message = str(info.value)
    assert "'float64x'" in message and "bfloat16" in message and "'auto'" in message


def test_errors_share_the_tlt_base():
    assert issubclass(tlt.CheckpointError, tlt.TltError) and issubclass(tlt.ConfigError, tlt.TltError)


def test_cli_prints_one_line_error_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "tlt.cli", "bench", "forward", "--model", "/nonexistent"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("tlt bench: error:"), result.stderr
    assert "/nonexistent" in lines[0]
