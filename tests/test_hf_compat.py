"""Hugging Face folders as an engineer brings them: tlt's logits and greedy rollouts equal transformers'
on the same weights for each Llama-family variant, config.json is read as transformers reads it, and what
tlt cannot compute is refused by name instead of loaded into another function."""

import re
from pathlib import Path

import pytest
import torch

import tlt
from conftest import edit_config, tiny_hf_model

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}

VARIANTS = {
    "llama-tied-mqa-wide-heads-sharded": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1, head_dim=32,
                                                         rope_theta=500000.0), "20KB"),
    "llama-biases-linear-rope": ("llama", dict(attention_bias=True, mlp_bias=True,
                                               rope_scaling={"type": "linear", "factor": 2.0}), None),
    "llama-llama3-rope-short-context": ("llama", dict(rope_scaling=LLAMA3, max_position_embeddings=48), None),
    "qwen2-yarn-untied": ("qwen2", dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 16}), None),
    "qwen3-attention-bias-narrow-heads-tied": ("qwen3", dict(attention_bias=True, head_dim=8, tie_word_embeddings=True),
                                               None),
}


def save(tmp_path: Path, arch: str, shard: str | None = None, dtype: torch.dtype | None = None, **overrides):
    """A tiny transformers model saved into tmp_path (as `dtype`, in shards of `shard` when given), and
    the float32 model transformers loads back from that folder."""
    from transformers import AutoModelForCausalLM

    model = tiny_hf_model(arch, **overrides)
    folder = tmp_path / arch
    (model.to(dtype) if dtype else model).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), folder


def assert_same_logits(hf, model, length: int = 40) -> None:
    ids = torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_rollout_equal_transformers(tmp_path, variant):
    arch, overrides, shard = VARIANTS[variant]
    hf, folder = save(tmp_path, arch, shard, **overrides)
    model = tlt.load_model(folder)
    assert_same_logits(hf, model)
    prompt = torch.randint(3, 97, (7,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = tlt.RolloutEngine(model, None, tlt.EngineConfig(progress=False))
    out = engine.generate([prompt.tolist()], tlt.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == expected[0, 7:].tolist()


def test_bf16_checkpoint_loads_as_float32_with_transformers_logits(tmp_path):
    hf, folder = save(tmp_path, "qwen3", shard="20KB", dtype=torch.bfloat16)
    model = tlt.load_model(folder)
    assert model.dtype == torch.float32
    assert_same_logits(hf, model)


def test_rope_scaling_replaces_rope_parameters_as_in_transformers(tmp_path):
    """A config holding both layouts (a transformers 5 config.json given an older `rope_scaling`) was
    merged, so rope_parameters' rope_type "default" hid the linear scaling and tlt ran unscaled RoPE with
    rope_parameters' theta; transformers reads rope_scaling alone."""
    hf, folder = save(tmp_path, "llama")
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                rope_scaling={"type": "linear", "factor": 4.0})
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert tlt.load_config(folder).rope_scaling["rope_type"] == "linear"
    assert_same_logits(hf, tlt.load_model(folder))


def test_absent_fields_take_transformers_defaults_for_the_architecture(tmp_path):
    """A Qwen3 config.json without head_dim means 128 to transformers and without num_key_value_heads 32
    (tlt read hidden / heads and the number of heads, and refused the weights); a Qwen config without
    max_position_embeddings means a 32768-token context (tlt capped rollouts at 2048)."""
    hf, folder = save(tmp_path, "qwen3", head_dim=128, num_attention_heads=32, num_key_value_heads=32)
    edit_config(folder, head_dim=None, num_key_value_heads=None, max_position_embeddings=None)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = tlt.load_model(folder)
    assert (model.config.head_dim, model.config.num_key_value_heads) == (128, 32)
    assert model.config.max_position_embeddings == hf.config.max_position_embeddings == 32768
    assert_same_logits(hf, model)


def test_mlp_bias_is_a_llama_field_only(tmp_path):
    """Qwen2 and Qwen3 MLPs have no bias whatever config.json says; tlt read `mlp_bias` for them too and
    refused the weights for lacking the biases transformers never builds."""
    hf, folder = save(tmp_path, "qwen2")
    edit_config(folder, mlp_bias=True)
    assert_same_logits(hf, tlt.load_model(folder))


def test_rotary_frequencies_stored_by_older_checkpoints_are_ignored(tmp_path):
    """Old conversions store each attention's `rotary_emb.inv_freq`; transformers skips them (the
    frequencies come from config.json), tlt refused them as tensors the config does not use."""
    from safetensors.torch import load_file, save_file

    hf, folder = save(tmp_path, "llama")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_same_logits(hf, tlt.load_model(folder))


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_an_activation_other_than_silu_is_refused(tmp_path, act):
    """`hidden_act` was ignored: a GELU checkpoint loaded and ran tlt's SiLU MLP, logits off by 0.5."""
    _, folder = save(tmp_path, "llama", hidden_act=act)
    with pytest.raises(tlt.ConfigError) as info:
        tlt.load_model(folder)
    message = str(info.value)
    assert message.startswith(f"{folder / 'config.json'}: field 'hidden_act' is {act!r}") and "'silu'" in message


@pytest.mark.parametrize(
    "changes, message",
    [
        # bool("false") is True: the head was silently tied to the embedding.
        (dict(tie_word_embeddings="false"), "field 'tie_word_embeddings' must be true or false, got 'false'"),
        (dict(attention_bias="no"), "field 'attention_bias' must be true or false, got 'no'"),
        # A string never equals a sampled token: rollouts never stopped at the end of a response.
        (dict(eos_token_id="2"), "field 'eos_token_id' must be a token id or a list of token ids, got '2'"),
        (dict(eos_token_id=[2, "3"]), "field 'eos_token_id' must be a token id or a list of token ids"),
        (dict(pad_token_id=[0]), "field 'pad_token_id' must be a token id, got [0]"),
    ],
)
def test_mistyped_flags_and_token_ids_are_refused(tmp_path, changes, message):
    _, folder = save(tmp_path, "llama")
    path = edit_config(folder, **changes)
    with pytest.raises(tlt.ConfigError, match=re.escape(f"{path}: {message}")):
        tlt.load_model(folder)


@pytest.mark.parametrize("changes", [
    dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": None,
                          "original_max_position_embeddings": 64}),
    dict(rope_scaling={"type": "yarn", "factor": None, "original_max_position_embeddings": 32}),
])
def test_a_null_yarn_factor_is_derived_as_in_transformers(tmp_path, changes):
    """Regression: `"factor": null` was refused ("needs field 'factor'"); transformers derives it as
    max_position_embeddings / original_max_position_embeddings."""
    from transformers import AutoModelForCausalLM

    _, folder = save(tmp_path, "llama")
    edit_config(folder, **changes)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = tlt.load_config(folder)
    assert config.rope_scaling["factor"] == 256 / config.rope_scaling["original_max_position_embeddings"]
    assert_same_logits(hf, tlt.load_model(folder), length=80)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(rope_scaling={"type": "yarn", "original_max_position_embeddings": 64}),
         "rope scaling of type 'yarn' needs field 'factor' in 'rope_scaling' (or \"factor\": null, which transformers "
         "reads as max_position_embeddings / original_max_position_embeddings)"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
         "rope_type 'dynamic' is not supported (field 'rope_scaling'); expected one of default, linear, llama3, yarn"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}),
         "rope_type 'longrope' is not supported (field 'rope_parameters')"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
         "rope scaling of type 'llama3' needs field 'low_freq_factor' in 'rope_parameters'"),
        # float("8") would have read it; transformers' arithmetic would not.
        (dict(rope_scaling={**LLAMA3, "factor": "8"}), "field 'factor' of 'rope_scaling' must be a positive number"),
    ],
)
def test_rope_scaling_tlt_does_not_compute_is_refused_by_field(tmp_path, changes, message):
    _, folder = save(tmp_path, "llama")
    path = edit_config(folder, **changes)
    with pytest.raises(tlt.ConfigError, match=re.escape(f"{path}: {message}")):
        tlt.load_model(folder)


@pytest.mark.parametrize("kind", ["MistralForCausalLM", "GPT2LMHeadModel"])
def test_other_architectures_are_refused_by_name(tmp_path, kind):
    from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig

    config = (MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=97) if kind == "MistralForCausalLM"
              else GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(tlt.ConfigError) as info:
        tlt.load_model(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: architectures value {kind!r} is not supported")
    assert "LlamaForCausalLM" in message


def test_missing_weights_name_what_the_folder_holds_instead(tmp_path):
    """Both used to say only that model.safetensors is missing; a Trainer's training_args.bin beside unindexed
    shards is not taken for a weights file."""
    hf, folder = save(tmp_path, "llama", shard="20KB")
    (folder / "model.safetensors.index.json").unlink()
    torch.save({"lr": 1e-5}, folder / "training_args.bin")
    with pytest.raises(tlt.CheckpointError, match=r"model\.safetensors: weights file is missing; found "
                                                  r"\['model-00001-of-.*'\] but no model\.safetensors\.index\.json"):
        tlt.load_model(folder)
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(tlt.CheckpointError) as info:
        tlt.load_model(folder)
    assert str(info.value).startswith(f"{folder / 'model.safetensors'}: weights file is missing; found "
                                      "['pytorch_model.bin']: tlt reads safetensors only")
