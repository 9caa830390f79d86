"""Drafter export to the EAGLE layout (tlt/speculative/export.py): every drafter tlt trains is written
with exact names, shapes and values, and the written head, computed from its files alone as EAGLE-1
defines it, gives the drafter's feature; a drafter of another layout is refused with a clear error."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import tlt
from tlt.cli import main
from tlt.model.checkpoint import save_pretrained
from tlt.speculative.drafter import BUILTIN_DRAFTERS
from tlt.speculative.export import export_eagle, find_drafter

from random_weights import randomize_

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def make_target(tiny_model, folder, arch="LlamaForCausalLM", **overrides):
    switches = {"LlamaForCausalLM": {"qk_norm": False}, "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
                "Qwen3ForCausalLM": {"qk_norm": True}}
    model = tiny_model(architecture=arch, **{**switches[arch], **overrides})
    save_pretrained(model, folder)
    return model


def save_drafter(model, folder, **kwargs):
    """Save a drafter whose every parameter is random (fc.bias and the norm too, which from_target
    starts at 0 and 1), so that no tensor is checked only at its initial value."""
    drafter = randomize_(tlt.Drafter.from_target(model, seed=1, **kwargs), 0.1)
    drafter.save(folder)
    return drafter.eval()


def eagle_head(folder, embed, tokens, features):
    """The feature f_hat of the LlamaForCausalLMEagle head in `folder`, written from its config.json
    and model.safetensors alone: fc over cat(embed, feature), then one Llama layer whose input norm is
    the identity (causal GQA attention with rotate-half RoPE, RMSNorm, SwiGLU), and no output norm.
    tokens [B, T] at t+1, features [B, T, H] at t = 0..T-1."""
    c = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    heads, kv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    B, T = tokens.shape

    def linear(name, x):
        return x @ w[f"layers.0.{name}.weight"].T

    h = torch.cat([embed[tokens], features], -1) @ w["fc.weight"].T + w["fc.bias"]  # [B, T, H]
    q = linear("self_attn.q_proj", h).view(B, T, heads, D).transpose(1, 2)  # [B, heads, T, D]
    k = linear("self_attn.k_proj", h).view(B, T, kv, D).transpose(1, 2)  # [B, kv, T, D]
    v = linear("self_attn.v_proj", h).view(B, T, kv, D).transpose(1, 2)  # [B, kv, T, D]
    inv_freq = 1.0 / c["rope_theta"] ** (torch.arange(0, D, 2).float() / D)  # [D/2]
    angles = torch.arange(T).float()[:, None] * inv_freq  # [T, D/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [T, D]

    def rope(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)  # [B, heads, T, D]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # [B, heads, T, T]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, heads * D)  # [B, T, heads * D]
    h = h + linear("self_attn.o_proj", attended)
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]) * w["layers.0.post_attention_layernorm.weight"]
    return h + linear("mlp.down_proj", F.silu(linear("mlp.gate_proj", n)) * linear("mlp.up_proj", n))


def check_export(drafter, out):
    """The export of `drafter` in `out`: its config, its tensors by EAGLE name with the drafter's values,
    and the head they define computing the drafter's feature on random pairs."""
    c = drafter.target.config
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and not config["attention_bias"] and not config["mlp_bias"]
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings"):
        assert config[name] == getattr(c, name), name

    H, heads, kv, D, inter = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    shapes = {
        "fc.weight": (H, 2 * H), "fc.bias": (H,),
        "layers.0.self_attn.q_proj.weight": (heads * D, H), "layers.0.self_attn.k_proj.weight": (kv * D, H),
        "layers.0.self_attn.v_proj.weight": (kv * D, H), "layers.0.self_attn.o_proj.weight": (H, heads * D),
        "layers.0.mlp.gate_proj.weight": (inter, H), "layers.0.mlp.up_proj.weight": (inter, H),
        "layers.0.mlp.down_proj.weight": (H, inter), "layers.0.post_attention_layernorm.weight": (H,),
    }
    written = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in written.items()} == shapes
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(written[name.replace("layer.", "layers.0.", 1)], tensor.cpu()), name

    torch.manual_seed(0)
    tokens = torch.randint(0, c.vocab_size, (2, 9))
    features = torch.randn(2, 9, H)
    with torch.no_grad():
        f_hat, logits = drafter(tokens, features, torch.arange(9).expand(2, 9))
        expected = eagle_head(out, drafter.target.model.embed_tokens.weight.float(), tokens, features)
    assert (f_hat - expected).abs().max() <= 1e-5
    torch.testing.assert_close(logits, drafter.target.lm_head(expected))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_drafter_of_any_target_exports_to_the_head_it_computes(tiny_model, tmp_path, arch):
    model = make_target(tiny_model, tmp_path / "target", arch)
    drafter = save_drafter(model, tmp_path / "drafter")
    out = export_eagle(tmp_path / "drafter", tmp_path / "eagle", target=tmp_path / "target")
    check_export(drafter, out)
    from transformers import LlamaConfig

    hf = LlamaConfig.from_pretrained(out)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim) == (model.config.hidden_size, 1, model.config.head_dim)


def test_the_default_drafter_exports_against_its_named_target(tmp_path):
    model = tlt.load_model("default")
    drafter = tlt.Drafter.load("default", model)
    check_export(drafter, export_eagle(BUILTIN_DRAFTERS["default"], tmp_path / "eagle"))


def test_a_drafter_of_another_layout_is_refused_naming_its_tensors(tiny_model, tmp_path):
    """A drafter with a norm on its layer's input and an output norm, and an fc without bias, computes
    something EAGLE-1's head does not; writing its other tensors would silently serve another function."""
    model = make_target(tiny_model, tmp_path / "target")
    save_drafter(model, tmp_path / "drafter")
    weights = tmp_path / "drafter" / "drafter.safetensors"
    state = load_file(str(weights))
    H = model.config.hidden_size
    del state["fc.bias"]
    state.update({"layer.input_layernorm.weight": torch.ones(H), "norm.weight": torch.ones(H)})
    save_file(state, str(weights))
    pattern = r"missing tensors \['fc.bias'\], unexpected tensors \['layer.input_layernorm.weight', 'norm.weight'\]"
    with pytest.raises(tlt.CheckpointError, match=pattern):
        export_eagle(tmp_path / "drafter", tmp_path / "eagle", target=tmp_path / "target")
    assert not (tmp_path / "eagle").exists()
    with pytest.raises(tlt.CheckpointError, match=pattern):
        tlt.Drafter.load(tmp_path / "drafter", model)


def test_an_eagle3_drafter_is_refused(tiny_model, tmp_path):
    llama = make_target(tiny_model, tmp_path / "llama")
    tlt.Drafter.from_target(llama, feature_layers=(0, 1)).save(tmp_path / "eagle3")
    with pytest.raises(tlt.ConfigError, match="EAGLE-3"):
        export_eagle(tmp_path / "eagle3", tmp_path / "out", target=tmp_path / "llama")


def test_a_run_directory_exports_its_newest_drafter_against_its_policy(tiny_model, tmp_path):
    run = tmp_path / "run"
    drafters = {}
    for step in (2, 10):
        checkpoint = run / "checkpoints" / f"step_{step:08d}"
        model = make_target(tiny_model, checkpoint / "policy", seed=step)
        drafters[step] = save_drafter(model, checkpoint / "drafter")
    assert find_drafter(run) == run / "checkpoints" / "step_00000010" / "drafter"
    assert main(["export-drafter", str(run), str(tmp_path / "eagle")]) == 0
    written = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    assert torch.equal(written["fc.weight"], drafters[10].fc.weight.detach())
    (run / "drafter").mkdir()  # an empty folder is no drafter: the checkpoints' still wins
    assert find_drafter(run) == run / "checkpoints" / "step_00000010" / "drafter"
    save_drafter(model, run / "drafter")
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
    make_target(tiny_model, tmp_path / "wider", intermediate_size=64)
    with pytest.raises(tlt.CheckpointError, match=r"tensor 'layer.mlp.\w+_proj.weight' has shape"):
        export_eagle(tmp_path / "drafter", tmp_path / "out", target=tmp_path / "wider")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    with pytest.raises(tlt.CheckpointError, match="already exists"):
        export_eagle(tmp_path / "drafter", tmp_path / "taken", target=tmp_path / "target")
    (tmp_path / "drafter" / "drafter.safetensors").unlink()
    with pytest.raises(tlt.CheckpointError, match="weights file is missing"):
        export_eagle(tmp_path / "drafter", tmp_path / "out", target=tmp_path / "target")


def test_a_run_without_a_drafter_says_why_and_what_to_change(tmp_path, capsys):
    """Regression: export-drafter on a run that never trained a drafter said only that it "holds no drafter"."""
    import json

    from tlt.config import override, to_dict
    from tlt.rl.config import TrainConfig

    def run_dir(name, metrics=(), changes=None, config=None):
        """A run folder whose config.json is `config` (as written), else TrainConfig with `changes`."""
        folder = tmp_path / name
        folder.mkdir()
        base = TrainConfig(model="m", speculative="adaptive")
        config = config or to_dict(override(base, {"drafter.model": "random", **(changes or {})}))
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(metrics)))
        return folder

    cases = {
        "speculative=off": run_dir("off", changes={"speculative": "off"}),
        "n-gram drafts only (drafter.model='auto')": run_dir("auto", changes={"drafter.model": "auto"}),
        "drafter.train=off": run_dir("frozen", changes={"drafter.train": "off"}),
        "at most 700 pairs, fewer than drafter.min_pairs=2048": run_dir(
            "few", [{"drafter_buffer_pairs": 300}, {"drafter_buffer_pairs": 700}]),
        "no drafter phase ran in 1 steps": run_dir("idle", [{"drafter_buffer_pairs": 5000, "drafter_phase_steps": 0}]),
        "took 3 optimizer steps, but none scored above the drafter it started from": run_dir(
            "rejected", [{"drafter_buffer_pairs": 5000, "drafter_phase_steps": 3, "drafter_phase_kept": 0}]),
        "did not train its drafter (drafter.train=off)": run_dir("flat", config={  # the layout before groups
            "model": "m", "speculative": "adaptive", "drafter": "random", "drafter_train": "off"}),
    }
    for why, folder in cases.items():
        assert main(["export-drafter", str(folder), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "holds no drafter" in err and why in err, (why, err)
