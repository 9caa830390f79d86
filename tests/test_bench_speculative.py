"""Smoke test of `tlt bench speculative`: the measuring function runs every strategy on a tiny random
model and drafter, and writes the documented record; the engine config each system name stands for."""

import argparse
import json

import pytest
import torch

from tlt.bench import engine_config, fill_workload_defaults, speculative
from tlt.errors import ConfigError
from tlt.tasks import get_task
from tlt.io import atomic_write_json

STRATEGIES = ["off", "tree-d3-k2-v4", "ngram-d3"]


@pytest.fixture
def tiny_folders(tmp_path):
    """(model folder with the character tokenizer, drafter folder) of a random model and drafter."""
    from tlt.model import ModelConfig, Transformer
    from tlt.speculative import Drafter
    from tlt.tasks import CharTokenizer

    torch.manual_seed(0)
    config = ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256, qk_norm=True,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = Transformer(config).eval()
    model_dir, drafter_dir = tmp_path / "model", tmp_path / "drafter"
    model.save_pretrained(model_dir)
    CharTokenizer().save_pretrained(model_dir)
    Drafter.from_target(model, seed=1).save(drafter_dir)
    return model_dir, drafter_dir


def test_a_run_covers_whole_batches_of_at_least_the_requested_prompts():
    prompts = list(range(10))
    assert speculative.batches_of(prompts, 1, 3) == [[0], [1], [2]]
    assert speculative.batches_of(prompts, 2, 3) == [[0, 1], [2, 3]]
    assert speculative.batches_of(prompts, 4, 3) == [[0, 1, 2, 3]]


def test_measure_runs_every_strategy_and_fills_the_record(tiny_folders, tmp_path):
    model_dir, drafter_dir = tiny_folders
    record = speculative.measure(model_dir, drafter_dir, batch_sizes=[1, 2], strategies=STRATEGIES, max_tokens=16,
                                 repeats=1, skip_hf=True, prompts_per_run=2, command=["tlt", "bench", "speculative"], log=lambda s: None)
    atomic_write_json(tmp_path / "bench.json", record)
    record = json.loads((tmp_path / "bench.json").read_text())

    assert set(record) == {"config", "rows", "ratios"}
    config = record["config"]
    assert config["command"] == "tlt bench speculative"
    assert (config["batch_sizes"], config["strategies"], config["max_tokens"], config["prompts_per_run"]) == (
        [1, 2], STRATEGIES, 16, 2)
    assert [(r["batch"], r["strategy"]) for r in record["rows"]] == [(b, s) for b in (1, 2) for s in STRATEGIES]
    for row in record["rows"]:
        assert {"batch", "strategy", "acceptance_length", "tokens_per_s", "speedup_vs_off", "wall_s", "tokens"} <= set(row)
        assert row["tokens"] > 0 and row["wall_s"] > 0 and row["tokens_per_s"] > 0 and row["speedup_vs_off"] > 0
        if row["strategy"] == "off":
            assert row["acceptance_length"] is None and row["speedup_vs_off"] == row["paired_vs_off"] == 1.0
        else:
            assert row["acceptance_length"] >= 1
            # One repeat: the paired ratio is the ratio of the medians.
            assert row["paired_vs_off"] == pytest.approx(row["speedup_vs_off"])
    ratios = record["ratios"]
    assert set(ratios["speedup_vs_off"]) == {"tree-d3-k2-v4", "ngram-d3"}
    assert set(ratios["best_by_batch"]) == {"1", "2"}
    assert ratios["best_by_batch"]["1"]["strategy"] in STRATEGIES
    assert ratios["tree_strategy"] == "tree-d3-k2-v4" and ratios["tree_vs_off_batch1"] > 0
    assert "vs off" in speculative.format_table(record["rows"])


def test_dtype_puts_every_system_in_that_dtype(tiny_folders, monkeypatch):
    """dtype="bfloat16": tlt's engines (target and drafter), transformers' model and its assistant all run
    bf16 weights, and the record says so; baseline_dtype="float32" adds plain decoding in float32 to
    every batch size, and every row's ratio over it."""
    model_dir, drafter_dir = tiny_folders
    seen = []
    run_engine, run_hf = speculative.run_engine, speculative.run_hf

    def engine_spy(model, drafter, *args):
        seen.append(("tlt", model.dtype, None if drafter is None else next(drafter.parameters()).dtype))
        return run_engine(model, drafter, *args)

    def hf_spy(hf_model, batches, temperature, max_tokens, eos_id, pad_id, repeat, assistant=None):
        seen.append(("hf", hf_model.dtype, None if assistant is None else assistant.dtype))
        return run_hf(hf_model, batches, temperature, max_tokens, eos_id, pad_id, repeat, assistant)

    monkeypatch.setattr(speculative, "run_engine", engine_spy)
    monkeypatch.setattr(speculative, "run_hf", hf_spy)
    record = speculative.measure(model_dir, drafter_dir, batch_sizes=[1, 2], strategies=["off", "tree-d3-k2-v4"],
                                 max_tokens=8, repeats=1, prompts_per_run=2, dtype="bfloat16", baseline_dtype="float32",
                                 log=lambda s: None)
    assert (record["config"]["dtype"], record["config"]["baseline_dtype"]) == ("bfloat16", "float32")
    assert [(r["batch"], r["strategy"]) for r in record["rows"] if r["tokens_per_s"]] == [
        (1, "off"), (1, "tree-d3-k2-v4"), (1, "off_float32"), (1, "hf"), (1, speculative.HF_ASSISTED),
        (2, "off"), (2, "tree-d3-k2-v4"), (2, "off_float32")]
    # Every call but plain decoding in float32 (warm-up and one per batch size) ran bf16 weights.
    assert sorted(str(dtype) for _, dtype, _ in seen) == ["torch.bfloat16"] * 10 + ["torch.float32"] * 3
    assert {other for _, _, other in seen} == {None, torch.bfloat16}  # the drafter and the assistant
    rows = {(r["batch"], r["strategy"]): r for r in record["rows"]}
    for b in (1, 2):
        base = rows[b, "off_float32"]["tokens_per_s"]
        tree = rows[b, "tree-d3-k2-v4"]
        assert tree["speedup_vs_off_float32"] == pytest.approx(tree["tokens_per_s"] / base)
        assert tree["paired_vs_off_float32"] == pytest.approx(tree["speedup_vs_off_float32"])  # one repeat
        best = record["ratios"]["best_by_batch"][str(b)]
        assert best["strategy"] in ("off", "tree-d3-k2-v4")  # the baseline is not among the strategies
        assert best["speedup_vs_off_float32"] == pytest.approx(rows[b, best["strategy"]]["tokens_per_s"] / base)
    assert "vs off float32" in speculative.format_table(record["rows"])


def test_paired_ratio_is_the_median_of_within_repeat_ratios():
    off = [{"tokens": 100, "wall_s": 1.0}, {"tokens": 100, "wall_s": 2.0}, {"tokens": 100, "wall_s": 1.0}]
    tree = [{"tokens": 100, "wall_s": 0.5}, {"tokens": 100, "wall_s": 1.6}, {"tokens": 100, "wall_s": 0.8}]
    assert speculative.paired(tree, off) == pytest.approx(1.25)  # ratios 2.0, 1.25, 1.25
    assert speculative.paired(tree[:2], off) is None  # a system that failed in a repeat has no pairs
    assert speculative.paired(None, off) is None


def test_options_parse_lists():
    parser = argparse.ArgumentParser()
    speculative.add_arguments(parser)
    args = parser.parse_args(["--batch-sizes", "1,2", "--strategies", "off,ngram-d3", "--skip-hf"])
    assert args.batch_sizes == [1, 2] and args.strategies == ["off", "ngram-d3"] and args.skip_hf
    defaults = fill_workload_defaults(parser.parse_args([]))
    assert defaults.batch_sizes == [1, 4, 16, 64] and defaults.strategies == list(speculative.STRATEGIES)
    assert (defaults.model, defaults.task, defaults.drafter, defaults.max_tokens, defaults.repeats, defaults.dtype) == (
        "default", "arithmetic", "default", 640, 3, "float32")
    # the bench policy answers its own task, with its own drafter, up to the task's longest solution
    bench = fill_workload_defaults(parser.parse_args(["--model", "bench"]))
    assert (bench.task, bench.drafter, bench.max_tokens) == ("bench", "bench", get_task("bench").config.max_solution_tokens)
    given = fill_workload_defaults(parser.parse_args(["--model", "bench", "--task", "arithmetic", "--drafter", "d",
                                                      "--max-tokens", "50"]))
    assert (given.task, given.drafter, given.max_tokens) == ("arithmetic", "d", 50)
    with pytest.raises(SystemExit):
        parser.parse_args(["--task", "nope"])


def test_engine_config_maps_system_names():
    drafter = object()
    off = engine_config("off", drafter, progress=False)
    assert (off.speculative, off.drafter, off.progress) == ("off", None, False)
    adaptive = engine_config("adaptive", drafter, seed=3)
    assert (adaptive.speculative, adaptive.drafter, adaptive.seed) == ("adaptive", drafter, 3)
    fixed = engine_config("tree-d4-k2-v8", drafter)
    assert (fixed.speculative, fixed.strategy, fixed.drafter) == ("on", "tree-d4-k2-v8", drafter)
    with pytest.raises(ConfigError, match="catch_up_window"):
        engine_config("off", catch_up_window=0)


def test_drafter_bits_run_each_drafting_strategy_at_each_width_and_the_window_reaches_every_engine(tiny_folders, monkeypatch):
    """drafter_bits=[16, 4]: every drafting strategy runs twice, `S` on the drafter as it is and `S:q4` on
    its 4-bit weights (each with its own drafter), plain decoding and n-gram drafts once; the 4-bit systems
    count among the strategies of the ratios."""
    model_dir, drafter_dir = tiny_folders
    seen = []
    run_engine = speculative.run_engine

    def engine_spy(model, drafter, batches, strategy, temperature, max_tokens, repeat, bits=16, window=None):
        seen.append((strategy, bits, None if drafter is None else id(drafter)))
        windows.append(window)
        return run_engine(model, drafter, batches, strategy, temperature, max_tokens, repeat, bits, window)

    windows = []

    monkeypatch.setattr(speculative, "run_engine", engine_spy)
    record = speculative.measure(model_dir, drafter_dir, batch_sizes=[1], strategies=["off", "tree-d3-k2-v4", "ngram-d4"],
                                 max_tokens=8, repeats=1, prompts_per_run=2, dtype="bfloat16", skip_hf=True,
                                 drafter_bits=[16, 4], log=lambda s: None)
    assert [r["strategy"] for r in record["rows"]] == ["off", "tree-d3-k2-v4", "tree-d3-k2-v4:q4", "ngram-d4"]
    assert record["config"]["drafter_bits"] == [16, 4]
    assert "tree-d3-k2-v4:q4" in record["ratios"]["speedup_vs_off"]
    trees = {(bits, drafter) for strategy, bits, drafter in seen if strategy == "tree-d3-k2-v4"}
    assert {bits for bits, _ in trees} == {16, 4} and len({d for _, d in trees}) == 2
    record = speculative.measure(model_dir, drafter_dir, batch_sizes=[1], strategies=["off", "tree-d3-k2-v4"],
                                 max_tokens=8, repeats=1, prompts_per_run=2, dtype="bfloat16", skip_hf=True,
                                 drafter_bits=[4], log=lambda s: None)
    assert [r["strategy"] for r in record["rows"]] == ["off", "tree-d3-k2-v4:q4"]
    assert record["ratios"]["speedup_vs_off"]["tree-d3-k2-v4:q4"]["1"] is not None
    with pytest.raises(ConfigError, match="drafter-bits"):
        speculative.measure(model_dir, drafter_dir, batch_sizes=[1], strategies=["off"], drafter_bits=[8],
                            log=lambda s: None)
    assert set(windows) == {"auto"}  # EngineConfig's default unless a window is given
    from tlt.model import load_model
    from tlt.speculative import Drafter

    trained = Drafter.load(drafter_dir, load_model(model_dir)).config.train_window
    assert record["config"]["drafter_window_applied"] == (trained // 4 if trained else None)
    windows.clear()
    record = speculative.measure(model_dir, drafter_dir, batch_sizes=[1], strategies=["off", "tree-d3-k2-v4"],
                                 max_tokens=8, repeats=1, prompts_per_run=2, skip_hf=True, drafter_window=4,
                                 log=lambda s: None)
    assert set(windows) == {4} and record["config"]["drafter_window"] == 4
    with pytest.raises(ConfigError, match="drafter-window"):
        speculative.measure(model_dir, drafter_dir, batch_sizes=[1], strategies=["off"], drafter_window=-2,
                            log=lambda s: None)
