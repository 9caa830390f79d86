"""Drafter export to the EAGLE layout (tlt/speculative/export.py): exact names, shapes and values, or a
clear refusal when the drafter computes something the EAGLE head cannot."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tlt
from tlt.cli import main
from tlt.model.checkpoint import save_pretrained
from tlt.speculative.export import export_eagle, find_drafter

LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"]


def make_target(tiny_model, folder, arch="LlamaForCausalLM", **overrides):
    switches = {"LlamaForCausalLM": {"qk_norm": False}, "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
                "Qwen3ForCausalLM": {"qk_norm": True}}
    model = tiny_model(architecture=arch, **{**switches[arch], **overrides})
    save_pretrained(model, folder)
    return model


def save_drafter(model, folder, eagle1=True, **kwargs):
    """Save a drafter; with `eagle1`, without the two norms EAGLE-1's head lacks (its layer's input
    norm and its output norm), i.e. a drafter of exactly the structure the export maps."""
    tlt.Drafter.from_target(model, seed=1, **kwargs).save(folder)
    if eagle1:
        state = load_file(str(folder / "drafter.safetensors"))
        del state["layer.input_layernorm.weight"], state["norm.weight"]
        save_file(state, str(folder / "drafter.safetensors"))
    return load_file(str(folder / "drafter.safetensors"))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_export_writes_every_eagle_tensor_with_the_drafters_values(tiny_model, tmp_path, arch):
    from transformers import LlamaConfig

    model = make_target(tiny_model, tmp_path / "target", arch)
    state = save_drafter(model, tmp_path / "drafter")
    out = export_eagle(tmp_path / "drafter", tmp_path / "eagle", target=tmp_path / "target")

    config = json.loads((out / "config.json").read_text())
    c = model.config
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings"):
        assert config[name] == getattr(c, name), name
    assert config["attention_bias"] == (arch == "Qwen2ForCausalLM")
    hf = LlamaConfig.from_pretrained(out)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim) == (c.hidden_size, 1, c.head_dim)

    H, heads, kv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    inter = c.intermediate_size
    shapes = {
        "fc.weight": (H, 2 * H), "fc.bias": (H,),
        "layers.0.self_attn.q_proj.weight": (heads * D, H), "layers.0.self_attn.k_proj.weight": (kv * D, H),
        "layers.0.self_attn.v_proj.weight": (kv * D, H), "layers.0.self_attn.o_proj.weight": (H, heads * D),
        "layers.0.mlp.gate_proj.weight": (inter, H), "layers.0.mlp.up_proj.weight": (inter, H),
        "layers.0.mlp.down_proj.weight": (H, inter), "layers.0.post_attention_layernorm.weight": (H,),
    }
    if arch == "Qwen2ForCausalLM":
        shapes.update({f"layers.0.self_attn.{p}_proj.bias": (n,) for p, n in
                       (("q", heads * D), ("k", kv * D), ("v", kv * D), ("o", H))})
    written = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in written.items()} == shapes
    for name, tensor in state.items():
        assert torch.equal(written[name.replace("layer.", "layers.0.", 1)], tensor), name
    assert not written["fc.bias"].any()
    if arch == "Qwen2ForCausalLM":
        assert not written["layers.0.self_attn.o_proj.bias"].any()


def test_a_drafter_with_norms_eagle_lacks_is_refused(tiny_model, tmp_path):
    """tlt's drafter normalises its layer's input and its output; EAGLE-1's head does neither, so
    writing its weights as LlamaForCausalLMEagle would serve a different function."""
    model = make_target(tiny_model, tmp_path / "target")
    save_drafter(model, tmp_path / "drafter", eagle1=False)
    with pytest.raises(tlt.ConfigError, match="layer.input_layernorm.weight.*norm.weight"):
        export_eagle(tmp_path / "drafter", tmp_path / "eagle", target=tmp_path / "target")
    assert not (tmp_path / "eagle").exists()


def test_qwen3_qk_norm_and_eagle3_drafters_are_refused(tiny_model, tmp_path):
    qwen3 = make_target(tiny_model, tmp_path / "qwen3", "Qwen3ForCausalLM")
    save_drafter(qwen3, tmp_path / "d3")
    with pytest.raises(tlt.ConfigError, match="q_norm.*Qwen3"):
        export_eagle(tmp_path / "d3", tmp_path / "out", target=tmp_path / "qwen3")
    llama = make_target(tiny_model, tmp_path / "llama")
    tlt.Drafter.from_target(llama, feature_layers=(0, 1)).save(tmp_path / "eagle3")
    with pytest.raises(tlt.ConfigError, match="EAGLE-3"):
        export_eagle(tmp_path / "eagle3", tmp_path / "out", target=tmp_path / "llama")


def test_a_run_directory_exports_its_newest_drafter_against_its_policy(tiny_model, tmp_path):
    run = tmp_path / "run"
    states = {}
    for step in (2, 10):
        checkpoint = run / "checkpoints" / f"step_{step:08d}"
        model = make_target(tiny_model, checkpoint / "policy")
        states[step] = save_drafter(model, checkpoint / "drafter")
    assert find_drafter(run) == run / "checkpoints" / "step_00000010" / "drafter"
    assert main(["export-drafter", str(run), str(tmp_path / "eagle")]) == 0
    written = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    assert torch.equal(written["fc.weight"], states[10]["fc.weight"])
    (run / "drafter").mkdir()
    assert find_drafter(run) == run / "drafter"


def test_bad_inputs_give_clear_errors(tiny_model, tmp_path, capsys):
    with pytest.raises(tlt.CheckpointError, match="no such folder"):
        export_eagle(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(tlt.CheckpointError, match="holds no drafter"):
        export_eagle(tmp_path / "empty", tmp_path / "out")
    assert main(["export-drafter", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "holds no drafter" in capsys.readouterr().err

    model = make_target(tiny_model, tmp_path / "target")
    save_drafter(model, tmp_path / "drafter")
    with pytest.raises(tlt.ConfigError, match="--target"):
        export_eagle(tmp_path / "drafter", tmp_path / "out")
    make_target(tiny_model, tmp_path / "other", hidden_size=24, head_dim=6)
    with pytest.raises(tlt.CheckpointError, match="hidden_size"):
        export_eagle(tmp_path / "drafter", tmp_path / "out", target=tmp_path / "other")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    with pytest.raises(tlt.CheckpointError, match="already exists"):
        export_eagle(tmp_path / "drafter", tmp_path / "taken", target=tmp_path / "target")
    (tmp_path / "drafter" / "drafter.safetensors").unlink()
    with pytest.raises(tlt.CheckpointError, match="weights file is missing"):
        export_eagle(tmp_path / "drafter", tmp_path / "out", target=tmp_path / "target")
