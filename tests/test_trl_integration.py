"""TRL's GRPOTrainer rolling out with tlt's engine (tlt/integrations/trl.py): two real training steps
on a tiny random Qwen2 model with chat prompts, on CPU."""

import pytest
import torch

import tlt
from chat_tokenizer import build_chat_tokenizer
from conftest import tiny_hf_model
from tlt.integrations import make_rollout_func

trl = pytest.importorskip("trl")


def policy_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Log-probs the transformers policy gives the completion tokens (temperature 1, no truncation)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]  # [C, V]
        return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_two_grpo_steps_sample_from_the_current_policy(tmp_path, monkeypatch):
    from datasets import Dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    folder = tmp_path / "policy"
    policy = tiny_hf_model("qwen2", seed=1)
    policy.save_pretrained(folder)
    tokenizer = build_chat_tokenizer(folder, policy.config.vocab_size)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(4)]
    dataset = Dataset.from_dict({"prompt": prompts})

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
            "policy_logprobs": [policy_logprobs(model, p, c) for p, c in zip(out["prompt_ids"], out["completion_ids"])],
        })
        return out

    def reward_length(completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", max_steps=2,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=8, learning_rate=5e-2,
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward_length, args=args, train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=recorded)
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
        for ours, theirs in zip(out["logprobs"], call["policy_logprobs"]):
            assert ours == pytest.approx(theirs, abs=1e-4)
    assert "ngram-d4" in rollout.engine.stats()["strategies"]


def test_rollout_refuses_settings_it_cannot_honour(tmp_path):
    from types import SimpleNamespace

    from tlt.model.checkpoint import save_pretrained

    model = tlt.load_model("default")
    save_pretrained(model, tmp_path / "m")
    rollout = make_rollout_func(tmp_path / "m")
    args = SimpleNamespace(min_p=0.1, repetition_penalty=1.0, generation_kwargs=None, temperature=1.0, top_p=1.0,
                           top_k=0, max_completion_length=8)
    with pytest.raises(tlt.ConfigError, match="min_p"):
        rollout.sampling_params(SimpleNamespace(args=args, eos_token_ids=[2]))
    with pytest.raises(tlt.ConfigError, match="EngineConfig fields"):
        make_rollout_func(tmp_path / "m", speculate="on")
    with pytest.raises(tlt.ConfigError, match="only when a model folder"):
        make_rollout_func(rollout.engine, speculative="on")
