"""Bring your own model, data and reward: a Hugging Face Qwen2 folder saved by transformers (with a
byte-level chat tokenizer), a verl-layout Parquet file scored by the built-in math reward, and a
TRL-layout JSONL file scored by a user function given by import path in a worker process, with
speculation off and on."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chat_tokenizer import BYTE_VOCAB, build_byte_tokenizer, build_chat_tokenizer
from conftest import tiny_hf_model
from tlt.config import override
from tlt.errors import ConfigError
from tlt.rl import TrainConfig
from tlt.rl.run import train

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byo-model")
    tiny_hf_model("qwen2", vocab_size=BYTE_VOCAB, **SIZES).save_pretrained(folder)
    build_byte_tokenizer(folder)
    return folder


def tiny(model_dir, dataset, **overrides) -> TrainConfig:
    fields = {"model": str(model_dir), "dataset": str(dataset), "speculative": "off", "drafter.model": None,
              "workers": 1, "steps": 2, "prompts_per_step": 2, "group_size": 4, "max_response_tokens": 8,
              "eval.every": 2, "eval.problems": 2, "eval.samples": 2, "save_every": 0, "optim.lr": 1e-2}
    return override(TrainConfig(), {**fields, **overrides})


def run(config, run_dir) -> list[dict]:
    train(config, run_dir, log=lambda *_: None)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_verl_parquet_with_chat_prompts_and_the_math_reward(model_dir, tmp_path):
    rows = [{"data_source": "toy", "ability": "math",
             "prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"{i}+{i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
            for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    metrics = run(tiny(model_dir, tmp_path / "train.parquet", reward="math"), tmp_path / "run")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert "eval_accuracy" in metrics[0] and "eval_accuracy" in metrics[-1]  # eval on held-out rows of the dataset
    assert all(r["reward_errors"] == 0 for r in metrics[1:])  # every ground truth was readable


def write_trl_jsonl(path) -> None:
    """String prompts and an extra column `scale` that one row lacks (that row scores 0)."""
    lines = [{"prompt": f"Count to {i}:", "scale": 10.0} for i in range(5)] + [{"prompt": "Say nothing."}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("speculation", [dict(speculative="off"), dict(speculative="on", strategy="ngram-d4")],
                         ids=["off", "ngram-d4"])
def test_trl_jsonl_with_a_user_reward_in_a_worker_process(model_dir, tmp_path, speculation):
    write_trl_jsonl(tmp_path / "train.jsonl")
    config = tiny(model_dir, tmp_path / "train.jsonl", reward="reward_fixtures:scaled_words", reward_workers=1,
                  **speculation)
    metrics = run(config, tmp_path / "run")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for row in metrics[1:]:
        assert row["reward_errors"] == 0
        # A reward that never saw `scale` scores 0. With it, a completion of any visible text scores >= 10.
        assert row["reward"] > 1.0
        # The update learned something. Not `loss != 0`: at ratio 1 with responses of equal length a
        # group's advantages cancel in the loss's value (it is ~1e-8, once exactly 0.0), not in its gradient.
        assert row["grad_norm"] > 0.0
    if speculation["speculative"] == "on":
        assert all(r["acceptance_length"] is not None and set(r["strategies"]) == {"ngram-d4"} for r in metrics[1:])


def test_a_tokenizer_that_reads_nothing_of_a_prompt_is_named(tmp_path):
    """Regression: transformers 5 loads a word-level tokenizer saved beside a Qwen2 config.json as a
    Qwen2Tokenizer, which encodes "w1 w2" to no tokens; the run failed deep in the engine with
    "prompt 0 is empty", naming neither the row nor the tokenizer."""
    tiny_hf_model("qwen2", vocab_size=64, **SIZES).save_pretrained(tmp_path / "model")
    build_chat_tokenizer(tmp_path / "model", 64)
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    config = tiny(tmp_path / "model", tmp_path / "train.jsonl", reward="reward_fixtures:digit_fraction", eval={"every": 0})
    with pytest.raises(ConfigError, match=r"train.jsonl:1: the prompt encodes to no tokens .*Qwen2Tokenizer"):
        train(config, tmp_path / "run", log=lambda *_: None)


def test_train_drafter_on_a_chat_dataset_and_on_its_reference_completions(model_dir, tmp_path, capsys):
    """`tlt train-drafter --dataset`: the model's own generations on chat prompts rendered by the
    tokenizer's template (rows after the training ones held out), or a completion column as references."""
    from tlt.cli import main
    from tlt.model import load_model
    from tlt.speculative import Drafter

    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "solution": f"{2 * i}"} for i in range(8)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model", str(model_dir), "--dataset", str(tmp_path / "chat.jsonl"), "--prompts", "6",
              "--eval-prompts", "2", "--samples", "2", "--max-tokens", "8", "steps=2", "batch_tokens=32", "rows=2",
              "window=8", "log_every=1"]
    for data, extra in (("generations", []), ("references", ["--completion-column", "solution"])):
        out = tmp_path / f"drafter-{data}"
        assert main(["train-drafter", "--out", str(out), "--data", data, *extra, *common]) == 0
        recipe = json.loads((out / "recipe.json").read_text())
        assert recipe["data"]["dataset"] == str(tmp_path / "chat.jsonl") and recipe["metrics"]["step"] == 2
        Drafter.load(out, load_model(model_dir))
    capsys.readouterr()
    assert main(["train-drafter", "--out", str(tmp_path / "x"), "--data", "references", *common]) == 2
    assert "needs --completion-column" in capsys.readouterr().err
    assert main(["train-drafter", "--out", str(tmp_path / "x"), "--data", "references", "--completion-column", "answer",
                 *common]) == 2
    assert "column 'answer' is missing or not text" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_readme_example_files_train(tmp_path, monkeypatch):
    """`examples/byo.py` (the README's "Bring your own") writes a Llama folder, both dataset layouts and a
    reward module that `tlt train` takes as they are: one step on each file."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "byo.py"
    subprocess.run([sys.executable, str(script), str(tmp_path / "byo")], check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(tmp_path / "byo"))
    model = tmp_path / "byo" / "model"
    for dataset, reward in (("train.jsonl", "my_reward:weighted_answer"), ("train.parquet", "math")):
        config = tiny(model, tmp_path / "byo" / dataset, reward=reward, steps=1, eval={"every": 1}, max_response_tokens=6,
                      accuracy_threshold=0.5)
        metrics = run(config, tmp_path / f"run-{dataset}")
        assert [r["step"] for r in metrics] == [0, 1] and metrics[1]["reward_errors"] == 0
