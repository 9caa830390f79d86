"""The GRPO trainer end to end on a tiny random model: the importance ratio starts at 1, weights reach
the engine with their version, resume is exact, a non-finite loss stops the run with the last good
checkpoint intact, and bad config fails at start naming the key."""

import json

import pytest
import torch

from tlt.adaptive import TunerConfig
from tlt.config import from_dict, override, to_dict
from tlt.errors import ConfigError, StaleWeightsError, TrainingError
from tlt.rl import GRPOTrainer, TrainConfig
from tlt.rl.checkpoint import latest_checkpoint
from tlt.rl.run import train

from rl_fixtures import save_tiny_policy, tiny_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("rl-model"))


def config(model_dir, **overrides):
    return tiny_config(model_dir, **overrides)


# A fresh drafter, trained at every step on small batches (the tiny model's responses are short)
# every phase publishes its last step's (holdout 0): these runs check where the weights go, not whether a few
# steps on a tiny buffer beat the drafter on held-out responses (tests/test_spot.py checks that gate)
LEARNING = {"model": "random", "train": "every", "min_pairs": 1, "batch_tokens": 128, "window": 32, "holdout": 0.0}


@pytest.mark.parametrize("old_logprobs,dtype", [("rollout", "float32"), ("recompute", "float32"),
                                                ("recompute", "bfloat16")])
@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_importance_ratio_starts_at_one(model_dir, old_logprobs, dtype, warp):
    trainer = GRPOTrainer(config(model_dir, loss={"old_logprobs": old_logprobs}, dtype=dtype, **warp))
    recomputed = []
    recompute = trainer.recomputed_logprobs
    trainer.recomputed_logprobs = lambda episodes: recomputed.append(recompute(episodes)[0]) or (recomputed[-1], {})
    row = trainer.train_step()
    assert row["ratio_first_max_dev"] < 1e-3
    assert row["loss"] != 0.0  # the reward varies, so there was something to learn from
    if old_logprobs == "recompute":
        # Recomputed for exactly the responses the update's forward runs (advantage 0 ones need none)...
        assert len(recomputed[0]) == row["responses_in_update"]
        if dtype == "bfloat16":  # ...packed as it packs them: under autocast both run the same operators
            assert row["ratio_first_max_dev"] == 0.0
    trainer.close()


def test_update_slices_leave_out_zero_advantage_responses_unless_kl_or_entropy_reads_them(model_dir):
    from types import SimpleNamespace

    from tlt.rl.update import update_slices

    items = [SimpleNamespace(group=g, advantage=a, prompt_ids=[1, 2], completion_ids=[3] * (1 + i))
             for i, (g, a) in enumerate([(0, 0.0), (0, 0.0), (1, 0.5), (1, -0.5), (2, 0.0), (2, 1.0)])]
    c = config(model_dir, optim={"mini_batches": 2})
    slices = update_slices(items, c)
    assert [[id(s) for s in batch] for batch, _, _ in slices] == [[id(s) for s in items[:4]], [id(s) for s in items[4:]]]
    assert [[s.advantage for s in active] for _, active, _ in slices] == [[0.5, -0.5], [1.0]]
    assert sorted(id(e) for _, _, mbs in slices for mb in mbs for e in mb.episodes) == sorted(id(s) for s in items[2:4] + items[5:])
    with_kl = update_slices(items, config(model_dir, optim={"mini_batches": 2}, loss={"kl_coef": 0.1}))
    assert sum(len(active) for _, active, _ in with_kl) == len(items)


def test_weights_reach_the_engine_with_their_version(model_dir):
    trainer = GRPOTrainer(config(model_dir, loss={"old_logprobs": "rollout"}))
    before = {k: v.clone() for k, v in trainer.engine.model.state_dict().items()}
    trainer.train_step()
    assert trainer.engine.weights_version == trainer.step == 1
    for name, tensor in trainer.engine.model.state_dict().items():
        assert torch.equal(tensor, trainer.policy.state_dict()[name])
    assert any(not torch.equal(before[k], v) for k, v in trainer.engine.model.state_dict().items())
    with pytest.raises(StaleWeightsError, match="version 0"):
        trainer.engine.generate([[1, 5, 6]], weights_version=0)
    trainer.close()


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_kl_and_entropy_terms_run(model_dir, mini_batches):
    trainer = GRPOTrainer(config(model_dir, loss={"kl_coef": 0.05, "entropy_coef": 0.01, "aggregation": "sequence"},
                                 optim={"mini_batches": mini_batches}))
    first = trainer.train_step()
    second = trainer.train_step()
    if mini_batches == 1:  # the policy equals the reference until the step's only optimizer step
        assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    else:  # the second mini-batch sees a policy one optimizer step past the rollout's
        assert first["kl"] > 0 and first["ratio"] != pytest.approx(1.0, abs=1e-6)
    assert second["kl"] > 0
    assert second["entropy"] > 0
    trainer.close()


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time_") and k not in ("tokens_per_s", "eval_time_s")}


def test_resume_gives_the_same_next_step(model_dir, tmp_path):
    c = config(model_dir, steps=3, save_every=1, eval={"every": 3})
    whole = train(c, tmp_path / "whole", log=lambda *_: None).metrics
    train(c, tmp_path / "killed", log=lambda *_: None, stop_after=2)
    # A killed run may have written a metrics row after its last checkpoint; resume must drop it.
    with (tmp_path / "killed" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "reward": -1}) + "\n")
    (tmp_path / "killed" / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "dir": "step_00000002"}))
    resumed = train(c, tmp_path / "killed", resume=True, log=lambda *_: None).metrics
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert _comparable(resumed[-1]) == _comparable(whole[-1])
    assert _comparable(resumed[1]) == _comparable(whole[1])


def test_nan_loss_stops_with_the_last_checkpoint_intact(model_dir, tmp_path):
    c = config(model_dir, steps=3, save_every=1)
    train(c, tmp_path / "run", log=lambda *_: None, stop_after=1)
    saved = latest_checkpoint(tmp_path / "run")
    weights = (saved / "policy" / "model.safetensors").read_bytes()
    poisoned = from_dict(TrainConfig, {**json.loads((tmp_path / "run" / "config.json").read_text())})
    trainer = GRPOTrainer(poisoned, tmp_path / "run")
    with torch.no_grad():
        next(trainer.policy.parameters()).fill_(float("nan"))
    episodes = trainer.rollout(trainer.examples_for_step(0), 0)[0]
    for i, e in enumerate(episodes):
        e.advantage = 1.0 if i % 2 else -1.0
    with pytest.raises(TrainingError, match="loss is nan.*last good checkpoint"):
        trainer.update(episodes, {}, {})
    assert latest_checkpoint(tmp_path / "run") == saved
    assert (saved / "policy" / "model.safetensors").read_bytes() == weights
    trainer.close()


def test_run_directory_holds_metrics_checkpoints_and_eval(model_dir, tmp_path):
    c = config(model_dir, steps=2, save_every=1, eval={"every": 1}, keep_checkpoints=1)
    rows = train(c, tmp_path / "run", log=lambda *_: None).metrics
    assert rows[0]["step"] == 0 and "eval_accuracy" in rows[0] and "eval_pass@2" in rows[0]
    for key in ("reward", "response_length_p99", "time_rollout_s", "time_reward_s", "time_update_s", "time_sync_s",
                "time_logprob_s", "live_batch", "tokens_per_s", "eval_greedy_accuracy"):
        assert key in rows[-1]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_00000002"]
    with pytest.raises(ConfigError, match="already holds a run"):
        train(c, tmp_path / "run", log=lambda *_: None)


@pytest.mark.parametrize("fields, message", [
    ({"promts_per_step": "4"}, "promts_per_step"),
    ({"group_size": "1"}, "'group_size'"),
    ({"loss.aggregation": "mean"}, "'loss.aggregation'"),
    ({"optim.lr": "fast"}, "'optim.lr'"),
    ({"speculative": "on"}, "strategy"),
    ({"device": "gpu"}, "field 'device' must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ({"tuner.explore": "greedy"}, "field 'tuner.explore' must be one of"),
    ({"tuner.arms": "chain-d4,ngram-d4"}, "field 'tuner.arms' must include 'off'"),
    ({"tuner.arms": "off,bushy-d3"}, "field 'tuner.arms'.*bushy"),
    ({"drafter.catch_up_window": "-1"}, "field 'drafter.catch_up_window' must be an integer >= 0"),
    ({"drafter.unroll": "0"}, "field 'drafter.unroll' must be an integer >= 1"),
    ({"drafter.bits": "8"}, "field 'drafter.bits' must be one of"),
])
def test_bad_config_names_the_key(fields, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, fields)


def test_rollout_layout_puts_one_worker_on_each_gpu_by_default():
    from tlt.spot.rollout import rollout_layout

    assert rollout_layout(0, 0.0, cores=16, gpus=0) == (16, 0.0)  # CPU: one worker per core
    assert rollout_layout(0, 0.0, cores=16, gpus=8) == (8, 1.0)  # trainer on CUDA: one per GPU, holding it
    assert rollout_layout(0, 0.5, cores=16, gpus=8) == (8, 0.5)  # an explicit share is kept
    assert rollout_layout(0, 0.0, cores=16, gpus=1) == (1, 1.0)  # one GPU: the in-process engine
    assert rollout_layout(3, 0.0, cores=16, gpus=8) == (3, 0.0)  # explicit workers are left as set


def test_device_is_resolved_at_start(model_dir):
    from tlt.device import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():  # a missing GPU fails at start, naming the field
        with pytest.raises(ConfigError, match="field 'device' is 'cuda:0' but torch sees no CUDA device"):
            GRPOTrainer(config(model_dir, device="cuda:0"))
    trainer = GRPOTrainer(config(model_dir, device="cpu"))
    try:
        assert trainer.policy.device.type == trainer.engine.model.device.type == "cpu"
    finally:
        trainer.close()


def test_unknown_reward_fails_at_start(model_dir):
    with pytest.raises(ConfigError, match="no_such_module"):
        GRPOTrainer(config(model_dir, reward="no_such_module:f"))


def test_skipping_zero_advantage_responses_leaves_the_update_unchanged(model_dir):
    """Responses of all-equal groups are left out of the forward; the weights after the step must be
    the same as when every response runs."""
    from tlt.rewards import register

    @register("test-sparse")
    def sparse(prompts, completions, **_):  # groups 0 and 1 vary, groups 2 and 3 are all equal
        return [float(i % 2) if i < 8 else 0.5 for i in range(len(completions))]

    results = {}
    for skip in (True, False):
        trainer = GRPOTrainer(config(model_dir, reward="test-sparse", loss={"skip_zero_advantage": skip},
                                     optim={"mini_batches": 2}))
        row = trainer.train_step()
        results[skip] = ({k: v.clone() for k, v in trainer.policy.state_dict().items()}, row)
        trainer.close()
    assert results[True][1]["responses_in_update"] == 8 and results[False][1]["responses_in_update"] == 16
    assert results[True][1]["loss"] == pytest.approx(results[False][1]["loss"], abs=1e-6)
    for name, tensor in results[True][0].items():
        assert torch.allclose(tensor, results[False][0][name], atol=1e-6), name


def test_cli_train_rejects_unknown_key_and_resumes(model_dir, tmp_path, capsys):
    from tlt.cli import main

    assert main(["train", "--out", str(tmp_path / "bad"), "promts_per_step=4"]) == 2
    assert "promts_per_step" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    args = [f"model={model_dir}", "drafter.model=none", "speculative=off", "workers=1", "reward=reward_fixtures:digit_fraction",
            "train_problems=16", "prompts_per_step=2", "group_size=2", "max_response_tokens=6", "eval.every=0",
            "save_every=1", "steps=1"]
    assert main(["train", "--out", str(tmp_path / "run"), *args]) == 0
    assert main(["train", "--resume", str(tmp_path / "run"), "steps=2"]) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("train, window, expected", [("off", 64, 64), ("off", 0, None), ("off", None, None),
                                                      ("every", None, 8)])
def test_drafter_bits_and_window_reach_the_engines_drafter(model_dir, train, window, expected):
    """attention_window none: a quarter of the drafter's training window, a fresh drafter's none unless
    it learns online over drafter.window pairs."""
    trainer = GRPOTrainer(config(model_dir, speculative="adaptive", drafter={
        "model": "random", "train": train, "bits": 4, "attention_window": window, "window": 32, "batch_tokens": 128}))
    try:
        assert trainer.engine.decoder.spec.drafter.weight_bits == 4
        assert trainer.engine.decoder.spec.drafter_window == expected
    finally:
        trainer.close()


def test_auto_drafter_is_ngram_only_for_a_model_without_a_builtin_drafter(model_dir):
    lines = []
    c = from_dict(TrainConfig, {**to_dict(config(model_dir, drafter={"model": "auto"}, speculative="adaptive")),
                                "tuner": {"arms": "off,ngram-d4", "epsilon": "0.3", "explore": "uniform"},
                                "drafter.catch_up_window": "0"})
    trainer = GRPOTrainer(c, log=lines.append)
    assert trainer.engine.decoder.spec.drafter is None
    assert trainer.engine.tuner.config == TunerConfig(arms=("off", "ngram-d4"), epsilon=0.3, explore="uniform")
    assert trainer.engine.decoder.spec.catch_up_window is None  # 0: the drafter reads every pending pair
    assert any("n-gram drafts only" in line for line in lines)
    row = trainer.train_step()
    assert set(row["strategies"]) <= {"off", "ngram-d4"}
    trainer.close()


def test_dataset_eval_holds_rows_out_of_training(model_dir, tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = GRPOTrainer(config(model_dir, dataset=str(tmp_path / "d.jsonl"), eval={"every": 1, "problems": 4}),
                          log=lambda *_: None)
    assert [e.prompt for e in trainer.eval_examples] == ["6+1=", "7+1="]  # at most a quarter is held out
    assert not {e.prompt for e in trainer.eval_examples} & {e.prompt for e in trainer.train_examples}
    trainer.close()
    (tmp_path / "one.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ConfigError, match="too few to hold any out"):
        GRPOTrainer(config(model_dir, dataset=str(tmp_path / "one.jsonl"), eval={"every": 1}), log=lambda *_: None)


def test_in_process_drafter_training_and_the_three_run_comparison(model_dir, tmp_path):
    """workers=1: a due phase trains the engine's drafter in place after the rollout (counted as drafter
    time); `compare` runs off / tlt / frozen side by side and reports the alignment figures."""
    from tlt.bench.e2e import alignment, cold_start, compare
    from tlt.rl.side_by_side import matching_steps

    c = config(model_dir, speculative="adaptive", drafter={**LEARNING, "local_steps": 3}, steps=2, eval={"every": 2},
               max_response_tokens=24)
    result = compare(c, "adaptive", tmp_path / "bench", log=lambda *_: None)
    assert result["runs"] == ["off", "tlt", "frozen"]
    assert result["matching_steps"] == 2  # default arms: the tlt run drew the off run's very samples
    rows = [json.loads(x) for x in (tmp_path / "bench" / "tlt" / "metrics.jsonl").read_text().splitlines() if '"time_step_s"' in x]
    assert [r["drafter_phase_steps"] for r in rows] == [3, 3] and rows[-1]["drafter_version"] == 2
    assert all(r["time_drafter_s"] > 0 for r in rows)
    frozen_rows = [json.loads(x) for x in (tmp_path / "bench" / "frozen" / "metrics.jsonl").read_text().splitlines()
                   if '"time_step_s"' in x]
    assert all("drafter_version" not in r for r in frozen_rows)
    ratios = result["ratios"]
    assert ratios["drafter_overhead"] == pytest.approx(sum(r["time_step_s"] for r in rows) /
                                                       sum(r["time_step_s"] for r in frozen_rows))
    assert (tmp_path / "bench" / "e2e.png").stat().st_size > 0
    # the figures themselves, on rows with known values
    def row(chain, tree, rows_chain, rows_tree, t):
        return {"drafter_acceptance_length": None, "time_step_s": t,
                "acceptance_by_strategy": {"chain-d4": chain, "tree-d6-k4-v24": tree, "ngram-d4": 9.0},
                "rows_by_strategy": {"chain-d4": rows_chain, "tree-d6-k4-v24": rows_tree, "ngram-d4": 5}}

    a = [row(1.0, 1.0, 10, 10, 2.0), row(3.0, 4.0, 30, 10, 2.0), row(3.0, 4.0, 30, 10, 2.0)]
    b = [row(1.0, 1.0, 10, 10, 1.0), row(2.0, 5.0, 10, 30, 1.0), row(2.0, 5.0, 10, 30, 1.0)]
    fig = alignment(a, b, last=2)
    assert fig["acceptance_by_arm"]["chain-d4"]["ratio"] == 1.5  # arm by arm: the mix does not matter
    assert fig["acceptance_by_arm"]["tree-d6-k4-v24"]["ratio"] == 0.8
    assert fig["acceptance_adaptive_vs_frozen"] == pytest.approx((1.5 * 60 + 0.8 * 20) / 80)
    assert "ngram-d4" not in fig["acceptance_by_arm"] and fig["drafter_overhead"] == 2.0
    strat = [{"acceptance_by_strategy": s} for s in ({"chain-d4": 1.1, "ngram-d4": 1.5}, {"chain-d4": 1.9, "ngram-d4": 1.6},
                                                    {"ngram-d4": 1.7}, {"chain-d4": 2.5, "ngram-d4": 1.6})]
    assert cold_start(strat)["overtake_step"] == 2
    assert cold_start(strat[:1])["overtake_step"] is None
    same = {"response_lengths": [3, 5], "reward": 0.5}
    assert matching_steps([same, same, same], [same, {**same, "response_lengths": [3, 6]}, same]) == 1
    assert matching_steps([same], [{**same, "reward": 0.25}]) == 0 and matching_steps([same] * 2, [same] * 2) == 2
    top1 = [{"acceptance_by_strategy": {"tree-d4-k1-v4": a, "chain-d4": 9.0, "ngram-d4": 1.5}} for a in (1.0, 2.0)]
    assert cold_start(top1)["learned_arm"] == "tree-d4-k1-v4" and cold_start(top1)["overtake_step"] == 2


def test_adaptive_speculation_reproduces_the_plain_run(model_dir):
    """With the default arms (target-only verification) a tlt run samples exactly what the plain run
    samples, so with recomputed old log-probs it is the same run: same rewards and lengths at every
    step, and bit-identical weights after it."""
    runs = {}
    for speculative in ("off", "adaptive"):
        trainer = GRPOTrainer(config(model_dir, speculative=speculative, drafter={"model": "random", "train": "off"},
                                     loss={"old_logprobs": "recompute"}, temperature=1.0, max_response_tokens=24,
                                     tuner={"epsilon": 0.5, "explore": "uniform", "prune_ratio": 0}))
        rows = [trainer.train_step() for _ in range(3)]
        runs[speculative] = (rows, {k: v.clone() for k, v in trainer.policy.state_dict().items()},
                             set(trainer.engine.stats()["strategies"]))
        trainer.close()
        if speculative == "adaptive":
            assert trainer.engine.decoder.spec.catch_up_window == 16  # the default reaches the engine
            assert trainer.engine.decoder.spec.drafter_window is None  # "auto", a fresh drafter: the whole context
    (off_rows, off_weights, _), (tlt_rows, tlt_weights, arms) = runs["off"], runs["adaptive"]
    assert len(arms - {"off"}) >= 2  # the tlt run really speculated, with several arms
    for a, b in zip(off_rows, tlt_rows):
        assert a["response_lengths"] == b["response_lengths"] and a["reward"] == b["reward"]
    assert all(torch.equal(off_weights[k], tlt_weights[k]) for k in off_weights)


def test_buffer_policies_plug_in_by_import_path(model_dir):
    c = config(model_dir, speculative="adaptive", steps=1,
               drafter={**LEARNING, "local_steps": 1, "buffer_sample": "reward_fixtures:shortest_first"})
    trainer = GRPOTrainer(c, log=lambda *_: None)
    try:
        trainer.train_step()
        buffer = trainer.rollout_backend.learning.buffer
        assert buffer.sample(buffer.entries) == [1.0 / e.pairs for e in buffer.entries]
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match="drafter.buffer_evict"):
        GRPOTrainer(config(model_dir, speculative="adaptive", drafter={"model": "random", "buffer_evict": "nowhere:fn"}))


def test_resume_with_drafter_training_trains_on_the_saved_buffer(model_dir, tmp_path):
    """With the online buffer in the checkpoint, the step after a resume trains the drafter on the data the
    uninterrupted run had (same loss, same drafter, same acceptance); without it (the control) the
    resumed buffer holds only the newest rollout."""
    def comparable(row):
        timing = ("tokens_per_s", "eval_time_s", "drafter_phase_s", "drafter_stop_latency_s")
        return {k: v for k, v in row.items() if not k.startswith("time_") and k not in timing}

    fields = dict(speculative="on", strategy="tree-d3-k2-v4", steps=3, save_every=1, eval={"every": 0},
                  max_response_tokens=24)
    drafter = {**LEARNING, "local_steps": 2}
    whole = train(config(model_dir, drafter=drafter, **fields), tmp_path / "whole", log=lambda *_: None).metrics
    for saved in (True, False):
        run = tmp_path / f"buffer-{saved}"
        c = config(model_dir, drafter={**drafter, "buffer_checkpoint": saved}, **fields)
        train(c, run, log=lambda *_: None, stop_after=2)
        folder = latest_checkpoint(run)
        assert (folder / "drafter_buffer" / "buffer.safetensors").is_file() == saved
        resumed = train(c, run, resume=True, log=lambda *_: None).metrics
        if saved:
            assert comparable(resumed[-1]) == comparable(whole[-1])
        else:
            assert resumed[-1]["drafter_buffer_pairs"] < whole[-1]["drafter_buffer_pairs"]
            assert resumed[-1]["drafter_top1"] != whole[-1]["drafter_top1"]


def test_online_buffer_round_trips_and_names_a_bad_file(tmp_path):
    from tlt.errors import CheckpointError
    from tlt.speculative.data import DraftRecord
    from tlt.spot.buffer import OnlineBuffer

    buffer = OnlineBuffer(max_bytes=1 << 20)
    big = torch.randn(10, 4)
    buffer.add([DraftRecord(torch.arange(6), big[:6], 2), DraftRecord(torch.arange(4), big[6:], 1)], version=3)
    buffer.add([DraftRecord(torch.arange(5), torch.randn(5, 4), 3)], version=4)
    buffer.save(tmp_path / "b")
    again = OnlineBuffer(max_bytes=1 << 20)
    again.load(tmp_path / "b")
    assert [(e.version, e.order, e.record.prompt_len) for e in again.entries] == \
           [(e.version, e.order, e.record.prompt_len) for e in buffer.entries]
    for a, b in zip(again.entries, buffer.entries):
        assert torch.equal(a.record.tokens, b.record.tokens) and torch.equal(a.record.features, b.record.features)
    assert again.stats() == buffer.stats()
    index = json.loads((tmp_path / "b" / "buffer.json").read_text())
    index["entries"][1].pop("prompt_len")
    (tmp_path / "b" / "buffer.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"buffer\.json: entry 1 has no 'prompt_len'"):
        again.load(tmp_path / "b")


def test_online_training_of_an_eagle3_drafter(model_dir, tmp_path):
    """A drafter fusing target layers (EAGLE-3 style) learns online too: rollout returns those layers'
    outputs with every token, the buffer keeps them, and a phase trains on them (with two
    training-time-test rounds, as EAGLE-3 trains)."""
    from tlt.model import load_model
    from tlt.speculative import Drafter

    Drafter.from_target(load_model(model_dir), feature_layers=(0, 1), seed=1).save(tmp_path / "eagle3")
    c = config(model_dir, speculative="on", strategy="chain-d3", steps=2,
               drafter={**LEARNING, "model": str(tmp_path / "eagle3"), "local_steps": 2, "unroll": 2})
    assert c.drafter.loss_config().unroll == 2  # the spot trainer's loss runs two training-time-test rounds
    trainer = GRPOTrainer(c, log=lambda *_: None)
    try:
        rows = [trainer.train_step() for _ in range(2)]
        entries = trainer.rollout_backend.learning.buffer.entries
        assert entries and all(e.record.layers is not None and e.record.layer_ids == (0, 1) for e in entries)
        assert all(e.record.layers.shape[0] == e.record.tokens.shape[0] for e in entries)
        assert [r["drafter_phase_steps"] for r in rows] == [2, 2] and rows[-1]["drafter_version"] == 2
    finally:
        trainer.close()


def test_compare_in_bfloat16_against_a_float32_baseline(model_dir, tmp_path):
    """rollout_dtype=bfloat16 shared by off and tlt, with `baseline_dtype="float32"`: a third run rolls out
    plain decoding in float32 with the engine's own log-probs, and the ratios compare tlt with it."""
    from tlt.bench.e2e import compare

    c = config(model_dir, rollout_dtype="bfloat16", loss={"old_logprobs": "recompute"},
               drafter={"model": "random", "train": "off"}, speculative="adaptive", steps=2, eval={"every": 2},
               max_response_tokens=16)
    result = compare(c, "adaptive", tmp_path / "bench", log=lambda *_: None, runs=("off", "tlt"),
                     baseline_dtype="float32")
    assert result["runs"] == ["off", "tlt", "off_float32"]
    baseline = json.loads((tmp_path / "bench" / "off_float32" / "config.json").read_text())
    assert (baseline["rollout_dtype"], baseline["loss"]["old_logprobs"], baseline["speculative"]) == \
        ("float32", "rollout", "off")
    assert json.loads((tmp_path / "bench" / "tlt" / "config.json").read_text())["rollout_dtype"] == "bfloat16"
    ratios, times = result["ratios"], result["curves"]
    assert ratios["speedup_vs_off_float32"] == pytest.approx(sum(times["off_float32"]["step_time_s"]) /
                                                             sum(times["tlt"]["step_time_s"]))
    breakdown = result["breakdown_s"]
    share = breakdown["off"]["rollout"] / sum(times["off"]["step_time_s"])
    assert ratios["rollout_share"] == pytest.approx(share)
    rollout = breakdown["off"]["rollout"] / breakdown["tlt"]["rollout"]
    assert ratios["amdahl_bound"] == pytest.approx(1 / ((1 - share) + share / rollout))
    assert ratios["rollout_speedup_vs_off_float32"] == pytest.approx(breakdown["off_float32"]["rollout"] /
                                                                     breakdown["tlt"]["rollout"])
    # the same dtype as the shared runs adds nothing
    same = compare(override(c, {"steps": 1, "eval.every": 1}), "adaptive", None, log=lambda *_: None,
                   runs=("tlt",), baseline_dtype="bfloat16")
    assert same["runs"] == ["tlt"] and not any(k.endswith("bfloat16") for k in same["ratios"])


@pytest.mark.parametrize("slow_bf16", [False, True])
def test_bfloat16_on_a_cpu_without_bf16_products_warns(model_dir, monkeypatch, slow_bf16):
    """An AVX2-only CPU runs bf16 products through PyTorch's reference kernels (tlt.device.slow_cpu_bf16): a run
    that asks for bf16 there is told what it costs; float32 runs and CPUs with bf16 products hear nothing."""
    import warnings

    import tlt.rl.trainer

    monkeypatch.setattr(tlt.rl.trainer, "slow_cpu_bf16", lambda: slow_bf16)
    for fields, warned in (({}, False), ({"dtype": "bfloat16"}, slow_bf16)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            GRPOTrainer(config(model_dir, **fields), log=lambda *_: None).close()
        assert any("fields 'dtype' / 'rollout_dtype'" in str(w.message) for w in caught) == warned, fields


def test_rollout_in_bfloat16_with_float32_master_weights(model_dir):
    """rollout_dtype=bfloat16: the engine holds bf16 weights (each sync casts the trainer's fp32 ones),
    old log-probs are recomputed by the trainer, so the first importance ratio is still 1, and the spot
    trainer trains a float32 twin of the engine's bf16 drafter."""
    with pytest.raises(ConfigError, match="'rollout_dtype'.*loss.old_logprobs=recompute"):
        config(model_dir, rollout_dtype="bfloat16")
    c = config(model_dir, rollout_dtype="bfloat16", loss={"old_logprobs": "recompute"}, speculative="on",
               strategy="tree-d3-k2-v4", drafter={**LEARNING, "local_steps": 3}, steps=2)
    trainer = GRPOTrainer(c, log=lambda *_: None)
    try:
        engine_drafter = trainer.engine.drafter
        before = {k: v.clone() for k, v in engine_drafter.state_dict().items()}
        rows = [trainer.train_step() for _ in range(2)]
        assert trainer.engine.model.dtype == torch.bfloat16 and trainer.policy.dtype == torch.float32
        assert all(r["ratio_first_max_dev"] < 1e-3 for r in rows) and rows[0]["loss"] != 0.0
        policy = trainer.policy.state_dict()
        for name, tensor in trainer.engine.model.state_dict().items():
            assert torch.equal(tensor, policy[name].to(torch.bfloat16)), name
        # the drafter trained as a float32 twin; the engine's bf16 drafter holds its weights, cast
        learned = trainer.rollout_backend.learning.state["drafter"]
        assert rows[-1]["drafter_phase_steps"] == 3 and all(v.dtype == torch.float32 for v in learned.values())
        for name, tensor in engine_drafter.state_dict().items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, learned[name].to(torch.bfloat16)), name
        assert any(not torch.equal(before[k], v) for k, v in engine_drafter.state_dict().items())
    finally:
        trainer.close()


def test_truncated_importance_sampling_corrects_bf16_rollouts(model_dir):
    """tis_cap with bf16 engines and a float32 trainer: the update weights tokens by min(pi_old / mu, C)
    and logs the ratio's mean and the share of tokens above the cap; it needs the recomputed pi_old."""
    from tlt.errors import ConfigError

    with pytest.raises(ConfigError, match="loss.tis_cap.*loss.old_logprobs=recompute"):
        config(model_dir, loss={"tis_cap": 2.0})
    with pytest.raises(ConfigError, match="loss.tis_cap"):
        config(model_dir, loss={"tis_cap": 0.5, "old_logprobs": "recompute"})
    c = config(model_dir, rollout_dtype="bfloat16", loss={"old_logprobs": "recompute", "tis_cap": 2.0}, steps=1)
    trainer = GRPOTrainer(c)
    row = trainer.train_step()
    trainer.close()
    assert 0.5 < row["tis_ratio"] < 2.0 and row["tis_ratio"] != 1.0  # bf16 and float32 probabilities differ a little
    assert 0.0 <= row["tis_clipped"] <= 1.0
    plain = GRPOTrainer(config(model_dir, steps=1))
    assert "tis_ratio" not in plain.train_step()
    plain.close()


def test_side_by_side_rotates_the_order_of_its_runs_step_by_step():
    """Runs stepped side by side take turns going first (off, tlt, frozen; tlt, frozen, off; ...), so no run
    always follows the same one; each run's rows stay its own, returned in config order."""
    from tlt.config import override
    from tlt.rl.config import TrainConfig
    from tlt.rl.side_by_side import SideBySide

    order = []

    class Stepper:  # what SideBySide asks of a trainer, recording when it is stepped
        def __init__(self, name):
            self.name, self.step = name, 0

        def train_step(self):
            self.step += 1
            order.append(self.name)
            return {"run": self.name, "step": self.step}

        def evaluate(self):
            return {"accuracy": 0.0}

    class Log:
        def write(self, row):
            pass

    names = ["off", "tlt", "frozen"]
    side = SideBySide.__new__(SideBySide)
    side.configs = {n: override(TrainConfig(), {"steps": 4}) for n in names}
    side.trainers = {n: Stepper(n) for n in names}
    side.logs = {n: Log() for n in names}
    side.rows, side.evals = {n: [] for n in names}, {n: [] for n in names}
    latest = [side.step() for _ in range(4)]
    assert order == ["off", "tlt", "frozen", "tlt", "frozen", "off", "frozen", "off", "tlt", "off", "tlt", "frozen"]
    assert list(latest[1]) == names and all(latest[1][n] == {"run": n, "step": 2} for n in names)
    assert [len(side.evals[n]) for n in names] == [1, 1, 1]  # each run's eval at its last step
