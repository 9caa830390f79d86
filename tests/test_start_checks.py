"""What `tlt train` checks before a run starts: every training and eval prompt (named by file:line),
the model folder's config.json, configuration values (blamed on where they came from, with the
closest field name for a typo), and on resume, that nothing is written until the merged config has
loaded."""

import json

import pytest

from chat_tokenizer import BYTE_VOCAB, build_byte_tokenizer
from conftest import tiny_hf_model
from tlt.cli import main
from tlt.config import build, from_dict, override, to_dict
from tlt.errors import ConfigError, TltError
from tlt.rl import GRPOTrainer, TrainConfig

from rl_fixtures import save_tiny_policy, tiny_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("start-model"))


def cli_args(model_dir, **overrides):
    fields = {"model": model_dir, "drafter.model": "none", "speculative": "off", "workers": 1,
              "reward": "reward_fixtures:digit_fraction", "train_problems": 16, "prompts_per_step": 2, "group_size": 2,
              "max_response_tokens": 6, "eval.every": 0, "save_every": 1, "steps": 1}
    fields.update(overrides)
    return [f"{k}={v}" for k, v in fields.items()]


def test_a_failed_resume_leaves_the_run_config_as_it_was(model_dir, tmp_path, capsys):
    """Regression: `--resume RUN dataset=missing.jsonl` rewrote RUN/config.json with the bad override
    before the dataset was read, so every later plain --resume failed too."""
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *cli_args(model_dir)]) == 0
    saved = (run / "config.json").read_text()
    assert main(["train", "--resume", str(run), f"dataset={tmp_path / 'missing.jsonl'}", "steps=2"]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert (run / "config.json").read_text() == saved
    assert main(["train", "--resume", str(run), "steps=2"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("where", ["train", "eval"])
def test_a_prompt_with_a_character_the_tokenizer_lacks_is_named_by_its_line(model_dir, tmp_path, where):
    """Regression: the built-in character tokenizer's ValueError surfaced as a 38-line traceback when
    the prompt's batch came up, steps into the run."""
    good = [json.dumps({"prompt": f"Q:{i}+1\nA:", "answer": str(i + 1)}) for i in range(8)]
    bad = json.dumps({"prompt": "Q:what is 2+2?\nA:", "answer": "4"})
    (tmp_path / "train.jsonl").write_text("\n".join(good[:5] + ([bad] if where == "train" else []) + good[5:]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(good[:1] + ([bad] if where == "eval" else [])) + "\n")
    config = tiny_config(model_dir, dataset=str(tmp_path / "train.jsonl"), eval_dataset=str(tmp_path / "eval.jsonl"),
                         eval={"every": 1})
    line = 6 if where == "train" else 2
    with pytest.raises(ConfigError, match=rf"{where}.jsonl:{line}: the prompt cannot be encoded .*character 'w'"):
        GRPOTrainer(config, log=lambda *_: None)


def test_a_prompt_longer_than_the_context_is_named_at_start(tmp_path):
    """Regression: it failed when its batch came up, as "prompt 2 has 802 tokens" (a batch position)."""
    tiny_hf_model("qwen2", vocab_size=BYTE_VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64).save_pretrained(tmp_path / "model")
    build_byte_tokenizer(tmp_path / "model")
    rows = [{"prompt": f"{i}+{i}="} for i in range(12)]
    rows[9]["prompt"] = "1+" * 40 + "1="
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    config = tiny_config(tmp_path / "model", dataset=str(tmp_path / "train.jsonl"), max_response_tokens=56)
    with pytest.raises(ConfigError, match=r"train.jsonl:10: the prompt has 82 tokens; the model's context .* is 64"):
        GRPOTrainer(config, log=lines.append)
    rows[9]["prompt"] = "1+" * 5 + "1="  # fits, but leaves less than max_response_tokens: said at start
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    GRPOTrainer(config, log=lines.append).close()
    assert any("1 of 12 prompts leave less than max_response_tokens=56" in x and "train.jsonl:10" in x for x in lines)


def test_a_corrupt_model_config_is_one_line_in_tlt_train(tmp_path, capsys):
    """Regression: with a Hugging Face tokenizer beside it, a corrupt config.json gave an 86-line
    traceback from transformers' tokenizer loader (tlt eval and tlt audit already said one line)."""
    tiny_hf_model("qwen2", vocab_size=BYTE_VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1).save_pretrained(tmp_path / "model")
    build_byte_tokenizer(tmp_path / "model")
    config = tmp_path / "model" / "config.json"
    config.write_text(config.read_text()[:-40])
    assert main(["train", "--out", str(tmp_path / "run"), f"model={tmp_path / 'model'}", "workers=1",
                 "speculative=off", "reward=reward_fixtures:digit_fraction"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("tlt train: error: ") and "model/config.json: line" in err
    assert not (tmp_path / "run").exists()
    from tlt.tokenizer import load_tokenizer

    from tlt.errors import CheckpointError
    with pytest.raises(CheckpointError, match="config.json: line"):
        load_tokenizer(tmp_path / "model")


def test_a_value_is_blamed_on_where_it_came_from(tmp_path):
    """Regression: a bad value given on the command line was reported as coming from the YAML file."""
    (tmp_path / "run.yaml").write_text("group_size: 4\nsteps: 3\n")
    with pytest.raises(ConfigError, match=r"^command line: field 'group_size' must be >= 2"):
        build(TrainConfig, tmp_path / "run.yaml", ["group_size=1"])
    with pytest.raises(ConfigError, match=r"^command line: field 'steps': expected int, got 'many'"):
        build(TrainConfig, tmp_path / "run.yaml", ["steps=many"])
    (tmp_path / "run.yaml").write_text("group_size: 1\n")
    with pytest.raises(ConfigError, match=r"run.yaml: field 'group_size' must be >= 2"):
        build(TrainConfig, tmp_path / "run.yaml", ["steps=3"])
    with pytest.raises(ConfigError, match=r"^run/config.json and command line: field 'optim.mini_batches' \(8\) must"):
        from_dict(TrainConfig, {"prompts_per_step": 4, "optim.mini_batches": "8"}, "run/config.json",
                  {"optim.mini_batches": "command line"})


def test_an_unknown_key_names_the_closest_field_not_all_of_them():
    """Regression: an unknown key printed all ~100 field names on one line."""
    with pytest.raises(ConfigError) as caught:
        from_dict(TrainConfig, {"prompt_per_step": "4"})
    message = str(caught.value)
    assert "unknown field 'prompt_per_step'" in message and "did you mean 'prompts_per_step'?" in message
    assert "drafter.buffer_mb" not in message and len(message) < 200
    with pytest.raises(ConfigError, match="'xyzzy'.*no field has a similar name.*tlt.rl.config.TrainConfig"):
        from_dict(TrainConfig, {"xyzzy": "1"})


def test_a_reward_failing_on_every_row_shows_in_the_table_and_stops_the_run(model_dir, tmp_path):
    """Regression: a reward failing on every row ended the run with exit code 0 and nothing on the
    console (only `reward_errors` in metrics.jsonl)."""
    from tlt.errors import TrainingError
    from tlt.rl.run import train

    lines = []
    config = tiny_config(model_dir, reward="reward_fixtures:poisoned", reward_failure_steps=2, steps=5, save_every=1)
    with pytest.raises(TrainingError, match=r"step 2: the reward 'reward_fixtures:poisoned' failed on every row of 2 "
                                            r"consecutive steps .*returned nan.*last good checkpoint"):
        train(config, tmp_path / "run", log=lines.append)
    header = next(x for x in lines if "rew err" in x)
    row = lines[lines.index(header) + 1]
    assert header.split()[:4] == ["step", "reward", "rew", "err"]
    assert row.split()[2] == "16"  # 4 prompts x 4 samples, all failed
    assert any(x.startswith("reward errors: 16 of 16 rows scored 0") for x in lines)
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("fields, message", [
    (dict(speculative="on", strategy="bushy-d3"), "field 'strategy' 'bushy-d3': Strategy field 'kind'"),
    (dict(speculative="on", strategy="tree-d4-k2-v8"),
     "'tree-d4-k2-v8' drafts with a learned drafter, but drafter.model is None"),
    ({"speculative": "adaptive", "drafter.model": "nowhere"}, "field 'drafter.model' 'nowhere': no such folder"),
    ({"speculative": "adaptive", "drafter.model": "default"},
     r"drafter_config.json \(field 'drafter.model'\): field 'hidden_size' is 192"),
    ({"speculative": "on", "strategy": "chain-d2", "drafter": {"model": "random", "buffer_evict": "no_such_module:keep"}},
     "field 'drafter.buffer_evict' 'no_such_module:keep': cannot import"),
])
def test_settings_that_cannot_work_fail_before_any_weights_load(model_dir, monkeypatch, fields, message):
    """Regression: a tree strategy without a drafter failed after the model loaded, with a ValueError
    traceback; a missing or mismatched drafter and a bad buffer policy also failed only then."""
    import tlt.model

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the settings were checked")

    monkeypatch.setattr(tlt.model, "load_model", no_weights)
    with pytest.raises(TltError, match=message):
        GRPOTrainer(from_dict(TrainConfig, {**to_dict(tiny_config(model_dir)), **fields}), log=lambda *_: None)


def test_a_group_larger_than_max_batch_size_runs(model_dir):
    """Regression: group_size > max_batch_size passed the config check and failed after the model loaded."""
    trainer = GRPOTrainer(tiny_config(model_dir, group_size=6, max_batch_size=4), log=lambda *_: None)
    row = trainer.train_step()
    trainer.close()
    assert len(row["response_lengths"]) == 4 * 6 and max(row["live_batch"]) <= 4


def test_accuracy_counts_rewards_at_or_above_the_threshold(model_dir):
    """Regression: accuracy counted a reward >= 1.0 whatever the reward's scale, so a reward whose best
    value is 0.5 (the README's example) showed accuracy 0.000 at every eval."""
    rows = {}
    for threshold in (1.0, 0.05):
        trainer = GRPOTrainer(tiny_config(model_dir, accuracy_threshold=threshold, eval={"every": 1}), log=lambda *_: None)
        episodes, _ = trainer.rollout(trainer.examples_for_step(0), 0)
        trainer.score(episodes)
        rows[threshold] = trainer.train_step() | trainer.evaluate()
        trainer.close()
        rewards = [e.reward for e in episodes]
        assert rows[threshold]["accuracy"] == sum(r >= threshold for r in rewards) / len(rewards)
    assert rows[1.0]["accuracy"] == rows[1.0]["eval_accuracy"] == 0.0  # digit_fraction is below 1 here
    assert rows[0.05]["accuracy"] > 0 and rows[0.05]["eval_accuracy"] > 0


@pytest.mark.parametrize("fields, message", [
    ({"optim.lr": "nan"}, "field 'optim.lr' must be a finite number, got nan"),
    ({"reward_timeout_s": "inf"}, "field 'reward_timeout_s' must be a finite number"),
    ({"top_p": "0"}, r"field 'top_p' must be in \(0, 1\]"),
    ({"top_k": "0"}, "field 'top_k' must be -1"),
    ({"optim.beta2": "1"}, r"field 'optim.beta2' must be in \[0, 1\)"),
    ({"optim.grad_clip": "0"}, "field 'optim.grad_clip' must be > 0"),
])
def test_train_config_refuses_values_that_would_fail_or_mislead_later(fields, message):
    """Regression: NaN passed every `x <= 0` check (lr=nan trained on NaN), top_p/top_k failed only when
    the first rollout built its SamplingParams, beta2=1 failed in AdamW after the model loaded, and
    grad_clip=0 silently zeroed every gradient."""
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, fields, "command line")


def test_a_truncated_eval_file_and_a_finished_run_are_said(model_dir, tmp_path):
    """Regression: eval_dataset was cut to eval.problems rows without a word, and resuming a finished run
    without raising steps printed only an empty table."""
    from tlt.rl.run import train

    rows = [json.dumps({"prompt": f"Q:{i}+1\nA:"}) for i in range(6)]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    lines = []
    config = tiny_config(model_dir, dataset=str(tmp_path / "d.jsonl"), eval_dataset=str(tmp_path / "d.jsonl"),
                         eval={"problems": 4}, steps=1, save_every=1)
    train(config, tmp_path / "run", log=lines.append)
    assert "eval on the first 4 of 6 examples" in lines[0]
    train(config, tmp_path / "run", resume=True, log=lines.append)
    assert any("the run is at step 1, and steps=1: nothing to train" in x for x in lines)


@pytest.mark.parametrize("argv", [
    ["eval", "--problems", "0"], ["eval", "--threads", "-1"], ["eval", "--temperature", "nan"],
    ["demo", "--threads", "-1"], ["audit", "--samples", "0"], ["audit", "--max-tokens", "0"],
    ["train-drafter", "--out", "x", "--samples", "0"], ["train-drafter", "--out", "x", "--temperature", "-1"],
    ["bench", "rollout", "--prompts", "-1"], ["bench", "rollout", "--samples", "0"],
    ["bench", "rollout", "--temperature", "nan"], ["bench", "roofline", "--prompt-len", "0"],
])
def test_cli_flags_are_checked_before_anything_loads(argv, capsys):
    """Regression: `tlt eval --problems 0` ended in an IndexError traceback and `--threads -1` (eval, demo)
    in torch's RuntimeError; other bad counts were reported as SamplingParams fields, not as the flag."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: expected" in capsys.readouterr().err


@pytest.mark.parametrize("field,value", [("lr", "nan"), ("lr", "0"), ("grad_clip", "0"), ("weight_decay", "-1"),
                                         ("warmup_steps", "-1")])
def test_sft_config_refuses_values_the_optimizer_would_fail_on_later(field, value):
    """Regression: `tlt sft lr=nan` built the model and then ended in torch's ValueError traceback."""
    from tlt.config import build
    from tlt.errors import ConfigError
    from tlt.sft import SFTConfig

    with pytest.raises(ConfigError, match=f"field '{field}'"):
        build(SFTConfig, None, [f"{field}={value}"])


def test_resume_reads_run_folders_that_hold_a_retired_setting(tmp_path):
    from tlt.config import to_dict
    from tlt.rl.run import resume_config

    saved = {**to_dict(TrainConfig(steps=3)), "drafter_fault": None}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert resume_config(tmp_path, ["steps=5"]).steps == 5
    (tmp_path / "config.json").write_text(json.dumps({**saved, "drafter_fault": "0:1:3"}))
    with pytest.raises(ConfigError, match="drafter_fault"):
        resume_config(tmp_path)
    with pytest.raises(ConfigError, match="not a run directory"):
        resume_config(tmp_path / "nope")


def test_a_run_whose_config_json_has_the_flat_keys_of_the_previous_release_resumes(model_dir, tmp_path):
    """config.json as the release before groups wrote it (every key flat: lr, drafter, drafter_train, ...):
    --resume reads it without a warning (tlt wrote those keys, not the user) and writes it back nested."""
    import warnings
    from pathlib import Path

    from tlt.rl.run import resume_config

    flat = json.loads((Path(__file__).parent / "flat_run_config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**flat, "lr": 0.01, "drafter_train": "off", "tuner_epsilon": 0.5,
                                                      "eval_every": 5, "wandb_project": "p"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = resume_config(tmp_path, ["steps=5"])
    # the run keeps the arms, buckets, exploration and history it was started with (the defaults of that release)
    assert config == override(TrainConfig(), {"steps": 5, "optim.lr": 0.01, "drafter.train": "off",
                                              "tuner.epsilon": 0.5, "eval.every": 5, "log.wandb_project": "p",
                                              "tuner.arms": tuple(flat["tuner_arms"]),
                                              "tuner.buckets": tuple(flat["tuner_buckets"]),
                                              "tuner.explore": flat["tuner_explore"],
                                              "history.responses": flat["history_responses"],
                                              "history.window": flat["history_window"]})
    run = tmp_path / "run"
    args = cli_args(model_dir)
    assert main(["train", "--out", str(run), *args]) == 0
    fields = dict(arg.split("=", 1) for arg in args)
    fields["drafter"], fields["eval_every"] = fields.pop("drafter.model"), fields.pop("eval.every")
    (run / "config.json").write_text(json.dumps({**flat, **fields}))
    assert main(["train", "--resume", str(run), "steps=2"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    written = json.loads((run / "config.json").read_text())
    assert written["drafter"]["model"] is None and written["optim"]["lr"] == 1e-4 and "drafter_train" not in written
    assert written["eval"]["every"] == 0 and "eval_every" not in written


def test_output_to_a_file_or_pipe_is_line_buffered(monkeypatch):
    """A long command run with its output in a file shows each line as it is printed."""
    import io
    import sys

    from tlt.cli import line_buffered_output

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", out)
    assert not out.line_buffering
    line_buffered_output()
    assert out.line_buffering
    print("a line")
    assert out.buffer.getvalue() == b"a line\n"  # written through at the newline, not held back
