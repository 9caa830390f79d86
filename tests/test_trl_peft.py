"""A PEFT LoRA policy in TRL's GRPOTrainer rolling out with tlt (tlt/integrations/trl.py): the engine
serves the base weights plus the adapters' deltas, computed without touching the trainer's weights; real
GRPO steps of a real trainer on a tiny random Qwen2 model; adapter kinds the merge cannot express are
refused by name."""

import datetime
import warnings
from types import SimpleNamespace

import pytest
import torch

import tlt
from conftest import tiny_hf_model
from test_trl_integration import policy_folder, policy_logprobs, trainer_on  # noqa: F401 (a fixture)
from tlt.integrations import make_rollout_func
from tlt.integrations.trl import lora_merged_state

peft = pytest.importorskip("peft")
pytest.importorskip("trl")


def lora_config(**config):
    """A LoRA adapter whose B starts random (PEFT's default zero B would hide the delta)."""
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"],
                              "init_lora_weights": False, **config})


def lora(model, **config):
    """`model` under a LoRA adapter (lora_config)."""
    return peft.get_peft_model(model, lora_config(**config))


def trainer_for(model, step: int = 0):
    """The parts of a trainer that a sync reads."""
    class State:  # held weakly by the sync
        global_step = step
    return SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m), state=State())


def test_grpo_steps_of_a_lora_policy_sample_from_the_adapted_policy(tmp_path, policy_folder):
    policy, folder, tokenizer, prompts = policy_folder
    base_before = {k: v.clone() for k, v in policy.state_dict().items()}
    rollout = make_rollout_func(folder, speculative="on", strategy="ngram-d4", seed=0)
    calls = []

    def recorded(prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        base = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
        out = rollout(prompts, trainer)
        was_training = model.training
        model.eval()  # LoRA dropout off: the policy's distribution, as the engine serves it
        calls.append({
            "out": out, "version": rollout.engine.weights_version,
            "base_kept": all(torch.equal(v, model.get_base_model().state_dict()[k]) for k, v in base.items()),
            "served": {k: v.clone() for k, v in rollout.engine.model.state_dict().items()},
            "policy_logprobs": [policy_logprobs(model, p, c, trainer.args.temperature)
                                for p, c in zip(out["prompt_ids"], out["completion_ids"])],
        })
        model.train(was_training)
        return out

    trainer = trainer_on(tmp_path, policy, tokenizer, recorded, prompts, max_steps=2, temperature=0.7,
                         peft_config=lora_config(modules_to_save=["lm_head"], lora_dropout=0.1))
    trainer.train()
    adapted = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(adapted, peft.PeftModel)

    assert [c["version"] for c in calls] == [0, 1]
    assert all(c["base_kept"] for c in calls), "a sync must not write the trainer's weights"
    for call in calls:
        for ours, theirs in zip(call["out"]["logprobs"], call["policy_logprobs"]):
            assert ours == pytest.approx(theirs, abs=1e-4)
    first, second = calls[0]["served"], calls[1]["served"]
    changed = {k for k in first if not torch.equal(first[k], second[k])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "lm_head.weight" in changed
    assert "model.layers.0.self_attn.k_proj.weight" not in changed  # no adapter there, base frozen
    frozen = lora_merged_state(adapted)
    assert all(torch.equal(frozen[k], v) for k, v in base_before.items()
               if "layers" in k and "q_proj" not in k and "v_proj" not in k and "mlp" not in k)


def test_the_merged_state_is_what_the_adapter_computes():
    """Against the adapted model's own logits, against PEFT's in-place merge, with adapters disabled, with
    a LoRA bias, and with the adapter merged already (not added twice)."""
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])

    def logits_of(state, **overrides):
        plain = tiny_hf_model("qwen2", seed=9, **overrides)
        plain.load_state_dict(state)
        with torch.no_grad():
            return plain(ids).logits

    # q_proj and v_proj have biases (Qwen2), so the adapter's own bias merges into theirs
    adapted = lora(tiny_hf_model("qwen2", seed=9), target_modules=["q_proj", "v_proj"], lora_bias=True).eval()
    assert adapted.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].bias.abs().sum() > 0
    with torch.no_grad():
        expected = adapted(ids).logits
    state = lora_merged_state(adapted)
    assert set(state) == set(tiny_hf_model("qwen2", seed=9).state_dict())
    torch.testing.assert_close(logits_of(state), expected, atol=1e-5, rtol=1e-5)
    with adapted.disable_adapter():
        base = lora_merged_state(adapted)
    assert all(torch.equal(base[k], v) for k, v in tiny_hf_model("qwen2", seed=9).state_dict().items())
    adapted.merge_adapter()
    merged, held = lora_merged_state(adapted), adapted.get_base_model().state_dict()
    for name, tensor in merged.items():  # taken as merged: the base weights as they are, no delta added again
        module, field = name.rsplit(".", 1)
        assert torch.equal(tensor, held.get(name, held.get(f"{module}.base_layer.{field}")))
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=1e-6)


def test_two_adapters_one_merged_are_served_as_peft_computes():
    """With two active adapters and one of them merged, PEFT's forward computes each adapted layer with its
    base weight alone (the merged adapter), leaving the unmerged one out; so must the engine."""
    ids = torch.tensor([[5, 9, 2, 33, 71, 8]])
    model = lora(tiny_hf_model("qwen2", seed=6))
    model.add_adapter("second", lora_config(target_modules=["q_proj", "up_proj"]))
    model.base_model.set_adapter(["default", "second"])
    plain = tiny_hf_model("qwen2", seed=6)
    for merge in (None, ["second"]):
        if merge:
            model.merge_adapter(merge)
        plain.load_state_dict(lora_merged_state(model))
        with torch.no_grad():
            torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_sync_sees_adapters_switched_at_the_same_step_and_warns_when_rounding(tmp_path, policy_folder):
    """Switching adapters off or merging them changes no parameter's version; the sync sees it all the same.
    A bf16 engine rounds away small LoRA changes: said once."""
    _, folder, _, _ = policy_folder
    rollout = make_rollout_func(folder)
    model, trainer = lora(tiny_hf_model("qwen2", seed=1)), None
    trainer = trainer_for(model)
    rollout.sync(trainer)
    adapted = rollout.engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"].clone()
    with model.disable_adapter():
        rollout.sync(trainer)
        base = rollout.engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(base, model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    rollout.sync(trainer)
    assert torch.equal(rollout.engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"], adapted)
    low = make_rollout_func(folder, dtype="bfloat16")
    with pytest.warns(UserWarning, match="bfloat16.*dtype='float32'"):
        low.sync(trainer_for(model))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        low.sync(trainer_for(model, step=1))  # said once


def test_an_adapter_added_through_transformers_is_merged_too():
    """transformers' own adapter support (`model.add_adapter`) records the config in `model.peft_config` and
    injects LoRA layers into the model with `peft.inject_adapter_in_model`, without a PeftModel around it
    (done here as it does, since transformers 5.25 asks for a newer PEFT than the index holds); the merged
    state computes what the adapted model computes."""
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    model, config = tiny_hf_model("qwen2", seed=2), lora_config()
    model = peft.inject_adapter_in_model(config, model)
    model.peft_config = {"default": config}
    plain = tiny_hf_model("qwen2", seed=2)
    plain.load_state_dict(lora_merged_state(model))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain(ids).logits, tiny_hf_model("qwen2", seed=2)(ids).logits, atol=1e-3)
    for layer in model.modules():
        if isinstance(layer, peft.tuners.lora.LoraLayer):
            layer.enable_adapters(False)  # what model.disable_adapters() does
    assert all(torch.equal(lora_merged_state(model)[k], v) for k, v in tiny_hf_model("qwen2", seed=2).state_dict().items())


def test_adapters_the_merge_cannot_express_are_refused_by_name(tmp_path, policy_folder):
    policy, folder, _, _ = policy_folder
    rollout = make_rollout_func(folder)
    cases = [
        (lora(tiny_hf_model("qwen2", seed=1), use_dora=True), "is a DoraLinearVariant"),
        (peft.get_peft_model(tiny_hf_model("qwen2", seed=1), peft.IA3Config(
            target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])), "IA3.*LoRA adapters only"),
        (peft.get_peft_model(tiny_hf_model("qwen2", seed=1), peft.PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=2)), "PROMPT_TUNING.*LoRA adapters only"),
        (lora(tiny_hf_model("qwen2", seed=1), trainable_token_indices=[5, 6]), "TrainableTokensWrapper"),
        (lora(tiny_hf_model("qwen2", seed=1), target_modules=["o_proj"], lora_bias=True),
         "o_proj adds a bias .lora_bias. to a layer without one"),
    ]
    for model, named in cases:
        with pytest.raises(tlt.ConfigError, match=named):
            rollout.sync(trainer_for(model))
    assert rollout._loaded is None  # nothing loaded on a refusal


def test_a_lora_delta_on_a_tied_embedding_is_refused_not_half_served(tmp_path):
    """With tied embedding and head, a LoRA on the embedding changes the lookup but not the head; the engine
    holds one tensor for both, so loading would keep whichever name came last."""
    folder = tmp_path / "tied"
    tiny_hf_model("qwen2", seed=4, tie_word_embeddings=True).save_pretrained(folder)
    rollout = make_rollout_func(folder)
    plain = lora(tiny_hf_model("qwen2", seed=4, tie_word_embeddings=True))
    rollout.sync(trainer_for(plain))  # adapters on projections only: served
    assert rollout.engine.weights_version == 0
    copies = {k: v.clone() for k, v in lora_merged_state(plain).items()}  # equal, not one tensor (a gather, Ray)
    rollout.engine.load_weights(copies, 7)
    assert rollout.engine.weights_version == 7
    adapted = lora(tiny_hf_model("qwen2", seed=4, tie_word_embeddings=True), target_modules=["embed_tokens"])
    with pytest.raises(tlt.ConfigError, match="ties model.embed_tokens.weight and lm_head.weight|ties lm_head.weight "
                                              "and model.embed_tokens.weight"):
        rollout.sync(trainer_for(adapted, step=1))


def test_a_lora_policy_under_fsdp2_is_gathered_and_merged(tmp_path):
    """Under FSDP2 the base weights and the adapter's A and B are DTensors of this process's shard: the
    merged state is the whole one, as the unsharded adapter's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    expected = lora_merged_state(lora(tiny_hf_model("qwen2", seed=3)))
    torch.manual_seed(0)
    sharded = lora(tiny_hf_model("qwen2", seed=3))
    folder = tmp_path / "policy"
    tiny_hf_model("qwen2", seed=5).save_pretrained(folder)
    rollout = make_rollout_func(folder)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in sharded.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        assert isinstance(sharded.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight, DTensor)
        trainer = trainer_for(sharded)
        trainer.accelerator.state = SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=2))
        rollout.sync(trainer)
    finally:
        dist.destroy_process_group()
    served = rollout.engine.model.state_dict()
    assert set(served) == set(expected)
    assert all(torch.equal(served[k], v) for k, v in expected.items())


def _sync_a_sharded_lora_policy(rank: int, folder: str, rendezvous: str, out: str) -> None:
    """One of two processes training a LoRA policy under FSDP2: shard it, sync tlt's engine, and (rank 0)
    save what the engine serves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    # a collective one process misses fails within two minutes instead of gloo's default half hour
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        sharded = lora(tiny_hf_model("qwen2", seed=3))
        mesh = init_device_mesh("cpu", (2,))
        for layer in sharded.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        a = sharded.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
        assert a.to_local().shape[0] < a.shape[0]  # each process holds part of the adapter only
        rollout = make_rollout_func(folder)
        trainer = trainer_for(sharded)
        trainer.accelerator.state = SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=2))
        rollout.sync(trainer)
        if rank == 0:
            torch.save(rollout.engine.model.state_dict(), out)
    finally:
        dist.destroy_process_group()


def test_a_lora_policy_sharded_over_two_processes_is_served_whole(tmp_path):
    """FSDP2 over two processes: each holds half of every weight and of the adapter's A and B; the engine
    serves the whole merged state, as the unsharded adapter's (up to the order of a sharded product's sums)."""
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    expected = lora_merged_state(lora(tiny_hf_model("qwen2", seed=3)))
    folder = tmp_path / "policy"
    tiny_hf_model("qwen2", seed=5).save_pretrained(folder)
    out = tmp_path / "served.pt"
    # Two processes talk over loopback sockets, which a busy host has failed once in many runs: a failed pair
    # is started again once, with a fresh rendezvous, and warned of (a merge that is wrong fails both times).
    for attempt in range(2):
        try:
            mp.spawn(_sync_a_sharded_lora_policy, args=(str(folder), str(tmp_path / f"rendezvous{attempt}"), str(out)),
                     nprocs=2)
            break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            if attempt:
                raise
            warnings.warn(f"the two-process sync failed once, started again: {exc}")
    served = torch.load(out)
    assert set(served) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(served[name], value, msg=name)
