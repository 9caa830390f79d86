"""TRL's GRPOTrainer rolling out with tlt's engine (tlt/integrations/trl.py): real training steps and
rollouts of real trainers on a tiny random Qwen2 model with chat prompts, on CPU, and the README's recipe
as written."""

import re
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tlt
from chat_tokenizer import build_chat_tokenizer
from conftest import edit_config, tiny_hf_model
from tlt.integrations import make_rollout_func

trl = pytest.importorskip("trl")


def policy_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """Log-probs the transformers policy gives the completion tokens at `temperature`, as TRL computes them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / temperature  # [C, V]
        return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def reward_length(completions, **kwargs):
    """Rewards that differ within a group, so that every step moves the policy."""
    return [float(len(c[0]["content"])) for c in completions]


def trainer_on(tmp_path, policy, tokenizer, rollout, prompts, peft_config=None, **config):
    """A GRPOTrainer on `prompts` (4 per step, 2 generations each) rolling out with `rollout`, training
    `policy` under a PEFT adapter of `peft_config` when given."""
    from datasets import Dataset

    args = trl.GRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False, "report_to": "none", "max_steps": 1,
        "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8,
        "learning_rate": 5e-2, "save_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0,
        "seed": 0, **config})
    return trl.GRPOTrainer(model=policy, reward_funcs=reward_length, args=args,
                           train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                           rollout_func=rollout, peft_config=peft_config)


@pytest.fixture
def policy_folder(tmp_path, monkeypatch):
    """(transformers policy, its folder, its chat tokenizer, chat prompts)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    folder = tmp_path / "policy"
    policy = tiny_hf_model("qwen2", seed=1)
    policy.save_pretrained(folder)
    tokenizer = build_chat_tokenizer(folder, policy.config.vocab_size)
    return policy, folder, tokenizer, [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(4)]


def test_two_grpo_steps_sample_from_the_current_policy(tmp_path, policy_folder):
    policy, folder, tokenizer, prompts = policy_folder
    rollout = make_rollout_func(folder, speculative="on", strategy="ngram-d4", seed=0)
    calls = []

    def recorded(prompts, trainer):
        out = rollout(prompts, trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        served = rollout.engine.model.state_dict()
        calls.append({
            "prompts": prompts, "out": out, "version": rollout.engine.weights_version,
            "step": trainer.state.global_step,
            "synced": all(torch.equal(served[k], v) for k, v in model.state_dict().items()),
            "weights": {k: v.clone() for k, v in served.items()},
            "policy_logprobs": [policy_logprobs(model, p, c, trainer.args.temperature)
                                for p, c in zip(out["prompt_ids"], out["completion_ids"])],
        })
        return out

    trainer = trainer_on(tmp_path, policy, tokenizer, recorded, prompts, max_steps=2, temperature=0.7)
    trainer.train()

    assert [c["step"] for c in calls] == [0, 1]
    assert [c["version"] for c in calls] == [0, 1]
    assert all(c["synced"] for c in calls)
    changed = [k for k in calls[0]["weights"] if not torch.equal(calls[0]["weights"][k], calls[1]["weights"][k])]
    assert changed, "the second rollout must sample from the updated policy"
    eos = set(trainer.eos_token_ids)
    for call in calls:
        prompts, out = call["prompts"], call["out"]
        assert len(prompts) == 4 and prompts[0] == prompts[1] and prompts[2] == prompts[3]
        assert [len(out[k]) for k in ("prompt_ids", "completion_ids", "logprobs")] == [4, 4, 4]
        rows = zip(prompts, out["prompt_ids"], out["completion_ids"], out["logprobs"])
        for prompt, ids, completion, logprobs in rows:
            assert ids == tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
            assert 1 <= len(completion) <= 8 and len(logprobs) == len(completion)
            assert len(completion) == 8 or completion[-1] in eos
            assert not eos & set(completion[:-1])
        for ours, theirs in zip(out["logprobs"], call["policy_logprobs"]):
            assert ours == pytest.approx(theirs, abs=1e-4)
    assert "ngram-d4" in rollout.engine.stats()["strategies"]


def test_a_second_train_call_samples_from_the_weights_the_first_left(tmp_path, policy_folder):
    """The engine's weights were keyed on the global step alone, so a second `train()` (which restarts at
    step 0, as a later phase or a sweep reusing the rollout_func does) sampled from the weights the first
    run started from."""
    policy, folder, tokenizer, prompts = policy_folder
    rollout = make_rollout_func(folder, seed=0)
    served = []

    def recorded(prompts, trainer):
        out = rollout(prompts, trainer)
        model, engine = trainer.accelerator.unwrap_model(trainer.model), rollout.engine.model.state_dict()
        served.append(all(torch.equal(engine[k], v) for k, v in model.state_dict().items()))
        return out

    trainer = trainer_on(tmp_path, policy, tokenizer, recorded, prompts)
    trainer.train()
    trainer.train()
    assert served == [True, True]


def test_weights_loaded_into_the_policy_at_the_same_step_are_the_ones_sampled(tmp_path, policy_folder):
    """The engine's weights were keyed on the step: weights loaded in place at the same step (as
    `load_best_model_at_end` does before an `evaluate()`) were not synced and the old ones were sampled.
    In-place writes bump the parameters' version counters, which the sync now reads too."""
    policy, folder, tokenizer, prompts = policy_folder
    rollout = make_rollout_func(folder, seed=0)
    trainer = trainer_on(tmp_path, policy, tokenizer, None, prompts)
    model = trainer.accelerator.unwrap_model(trainer.model)

    def served():
        engine = rollout.engine.model.state_dict()
        return all(torch.equal(engine[k], v) for k, v in model.state_dict().items())

    loads = []
    load_weights = rollout.engine.load_weights
    rollout.engine.load_weights = lambda state, version: loads.append(version) or load_weights(state, version)
    rollout(prompts[:1], trainer)
    assert served() and loads == [0]
    rollout(prompts[:1], trainer)  # nothing written since: no copy
    assert loads == [0]
    model.load_state_dict(tiny_hf_model("qwen2", seed=2).state_dict())  # another checkpoint, same step
    assert not served()
    rollout(prompts[:1], trainer)
    assert served() and loads == [0, 0]
    model.load_state_dict(tiny_hf_model("qwen2", seed=3).state_dict(), assign=True)  # new tensors, same counters
    assert not served()
    rollout(prompts[:1], trainer)
    assert served() and loads == [0, 0, 0]


def test_completions_stop_where_trl_counts_them_finished(tmp_path, policy_folder):
    """A token the folder's config.json calls eos but TRL's `eos_token_ids` (generation_config.json and
    the tokenizer) does not ended tlt's completions, which TRL then counted as truncated (and masked
    with mask_truncated_completions): completions stop at TRL's ids and nowhere else."""
    policy, folder, tokenizer, prompts = policy_folder
    trainer = trainer_on(tmp_path, policy, tokenizer, None, prompts)
    assert trainer.eos_token_ids == [2]
    (completion,) = make_rollout_func(folder, seed=0)(prompts[:1], trainer)["completion_ids"]
    assert completion[0] != 2
    edit_config(folder, eos_token_id=[2, completion[0]])
    extra_eos = make_rollout_func(folder, seed=0)
    assert completion[0] in extra_eos.engine.eos_ids
    assert extra_eos(prompts[:1], trainer)["completion_ids"] == [completion]


class OnProcess:
    """The trainer as process `index` of a multi-process run sees it."""

    def __init__(self, trainer, index: int) -> None:
        self._trainer = trainer
        self.accelerator = SimpleNamespace(process_index=index, unwrap_model=trainer.accelerator.unwrap_model)

    def __getattr__(self, name):
        return getattr(self._trainer, name)


def test_processes_of_one_run_draw_different_samples(tmp_path, policy_folder):
    """Every process builds its engine with the same `seed=`; a prompt's group split across processes
    got the same samples on each. Request seeds mix in the process index, and a process repeats."""
    policy, folder, tokenizer, prompts = policy_folder
    trainer = trainer_on(tmp_path, policy, tokenizer, None, prompts)
    group = prompts[:1] * 4
    first, again, other = (make_rollout_func(folder, seed=0)(group, OnProcess(trainer, i))["completion_ids"]
                           for i in (0, 0, 1))
    assert first == again
    assert first != other


def test_a_resumed_rollout_draws_what_the_uninterrupted_one_drew_and_eval_does_not_move_it(tmp_path,
                                                                                        policy_folder):
    """Request seeds came from one stream per rollout_func, so a run resumed at step N (a new process, a new
    rollout_func) replayed step 0's draws, and an eval call shifted the training draws after it. They are a
    function of the step and the call's place in it, train and eval apart."""
    policy, folder, tokenizer, prompts = policy_folder
    trainer = trainer_on(tmp_path, policy, tokenizer, None, prompts)
    group = prompts[:1] * 4
    trainer.model.train()
    running = make_rollout_func(folder, seed=0)
    at_step = {}
    for step in (0, 1):
        trainer.state.global_step = step
        at_step[step] = running(group, trainer)["completion_ids"]
    assert at_step[0] != at_step[1]
    resumed = make_rollout_func(folder, seed=0)  # a fresh process at step 1
    assert resumed(group, trainer)["completion_ids"] == at_step[1]
    with_eval = make_rollout_func(folder, seed=0)
    trainer.model.eval()
    with_eval(group, trainer)
    trainer.model.train()
    assert with_eval(group, trainer)["completion_ids"] == at_step[1]


def test_rollout_refuses_settings_it_cannot_honour(tmp_path, policy_folder):
    """Each trainer setting tlt cannot sample with is an error naming it; the ones it can are taken as set."""
    _, folder, _, _ = policy_folder
    rollout = make_rollout_func(folder)
    base = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", num_generations=2,
                per_device_train_batch_size=2)

    def sampling(tools=(), **config):
        trainer = SimpleNamespace(args=trl.GRPOConfig(**base, **config), eos_token_ids=[2], tools=list(tools))
        return rollout.sampling_params(trainer)

    for config, named in [({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.1}, "repetition_penalty"),
                          ({"generation_kwargs": {"suppress_tokens": [5]}}, "generation_kwargs .*suppress_tokens"),
                          ({"use_vllm": True}, "use_vllm"), ({"tools": [len]}, "tools"),
                          ({"top_p": 0.0}, "GRPOConfig.*top_p"),
                          ({"max_completion_length": 0}, "max_tokens is max_completion_length.*max_tokens")]:
        with pytest.raises(tlt.ConfigError, match=named):
            sampling(**config)
    params = sampling(min_p=0.0, temperature=0.7, top_p=0.9, top_k=5, max_completion_length=12)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.7, 0.9, 5, 12)
    assert params.stop_token_ids == (2,) and params.ignore_eos
    assert sampling().top_k == -1

    with pytest.raises(tlt.ConfigError, match="EngineConfig fields"):
        make_rollout_func(folder, speculate="on")
    with pytest.raises(tlt.ConfigError, match="only when a model folder"):
        make_rollout_func(rollout.engine, speculative="on")


def test_the_readme_recipe_runs_as_written(tmp_path, monkeypatch):
    """The README's TRL recipe, on the files examples/byo.py writes, trains its two steps as written."""
    root = Path(__file__).resolve().parents[1]
    section = (root / "README.md").read_text().split("### In TRL's `GRPOTrainer`", 1)[1]
    (recipe,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    runpy.run_path(str(root / "examples" / "byo.py"))["main"](Path("byo"))
    monkeypatch.syspath_prepend(str(tmp_path / "byo"))
    scope: dict = {}
    try:
        exec(compile(recipe, "README.md (TRL recipe)", "exec"), scope)
    finally:
        sys.modules.pop("my_reward", None)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    assert trainer.rollout_func.engine.weights_version == 1


def test_fsdp2_weights_are_gathered_and_zero3_and_fsdp1_are_refused(tmp_path, policy_folder):
    """A trainer under FSDP2 holds each parameter as a DTensor of this process's shard: the engine gets the
    whole weights. ZeRO-3 and FSDP1 parameters are placeholders outside their gathering contexts, which
    copied as tensors of shape (0,) failed on a shape mismatch naming neither: they are refused by name."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    policy, folder, _, _ = policy_folder
    rollout = make_rollout_func(folder)

    class TrainerState:  # the sync holds the run's state weakly
        def __init__(self, global_step):
            self.global_step = global_step

    def trainer_with(model, step, **plugins):
        state = SimpleNamespace(**{"deepspeed_plugin": None, "fsdp_plugin": None, **plugins})
        return SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m, state=state),
                               state=TrainerState(step))

    expected = tiny_hf_model("qwen2", seed=3).state_dict()
    sharded = tiny_hf_model("qwen2", seed=3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        assert all(isinstance(v, DTensor) for v in sharded.state_dict().values())
        rollout.sync(trainer_with(sharded, 0, fsdp_plugin=SimpleNamespace(fsdp_version=2)))
    finally:
        dist.destroy_process_group()
    served = rollout.engine.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in expected.items())
    for plugins, named in [({"deepspeed_plugin": SimpleNamespace(zero_stage=3)}, "DeepSpeed ZeRO-3"),
                           ({"fsdp_plugin": SimpleNamespace(fsdp_version=1)}, "FSDP1")]:
        with pytest.raises(tlt.ConfigError, match=f"shards the policy with {named}"):
            rollout.sync(trainer_with(policy, 1, **plugins))
