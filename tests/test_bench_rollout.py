"""`tlt bench rollout`: where the time goes by live batch size, and the best-per-bucket bound, by hand
and in a tiny run of the command."""

import json

import pytest
import torch

from tlt.adaptive.tuner import Tuner, TunerConfig
from tlt.bench.rollout import bucket_bound, bucket_split


def test_bucket_split_sums_steps_into_the_tuners_buckets():
    tuner = Tuner(TunerConfig(buckets=(1, 4)))
    split = bucket_split([0.5, 0.25, 0.125, 1.0, 2.0], [9, 8, 6, 4, 2], [9, 4, 3, 1, 1], tuner)
    assert split == {"seconds": {"1": 3.0, "2-4": 0.375, ">4": 0.5}, "tokens": {"1": 6, "2-4": 14, ">4": 9}}
    with pytest.raises(ValueError):  # step lists that do not line up are refused, not truncated
        bucket_split([0.5], [9, 8], [9, 4], tuner)


def test_bucket_bound_runs_plain_decodings_tokens_at_the_best_throughput_of_each_bucket():
    """Off emits 40 tokens in 4 s at one row and 60 in 2 s above; the tree is twice as fast at one row
    (but spends its time differently: 10 tokens in 0.5 s), the n-gram fastest at one row."""
    splits = {"tlt_off": {"seconds": {"1": 4.0, ">1": 2.0}, "tokens": {"1": 40, ">1": 60}},
              "tlt_tree": {"seconds": {"1": 0.5, ">1": 3.0}, "tokens": {"1": 10, ">1": 60}},
              "tlt_ngram": {"seconds": {"1": 1.0, ">1": 0.0}, "tokens": {"1": 40, ">1": 0}}}
    bound, best = bucket_bound(splits, ["tlt_off", "tlt_tree", "tlt_ngram"])
    assert best == {"1": "tlt_ngram", ">1": "tlt_off"}  # rates at one row: 10, 20, 40 tokens/s
    assert bound == pytest.approx(6.0 / (40 / 40 + 60 / 30))


def save_tiny_model_and_drafter(tmp_path) -> None:
    """A tiny random model with the built-in tokenizer in tmp_path/model, a random drafter in tmp_path/drafter."""
    from tlt.model import ModelConfig, Transformer
    from tlt.speculative import Drafter
    from tlt.tasks import CharTokenizer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256, qk_norm=True,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )).eval()
    model.save_pretrained(tmp_path / "model")
    CharTokenizer().save_pretrained(tmp_path / "model")
    Drafter.from_target(model, seed=1).save(tmp_path / "drafter")


def test_the_command_records_bucket_seconds_and_the_bound(tmp_path):
    """A tiny random model with the built-in tokenizer: off, one tree and adaptive, one repeat."""
    from tlt.cli import main

    save_tiny_model_and_drafter(tmp_path)
    out = tmp_path / "rollout.json"
    code = main(["bench", "rollout", "--model", str(tmp_path / "model"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", "2", "--samples", "3", "--max-tokens", "12", "--repeats", "1", "--skip-hf",
                 "--strategies", "tree-d2-k2-v3", "--adaptive", "--adaptive-arms", "off,tree-d2-k2-v3",
                 "--adaptive-tuner", "buckets=1,4  row_slope=false", "--json", str(out), "--plot", str(tmp_path / "live.png")])
    assert code == 0
    assert (tmp_path / "live.png").exists() and (tmp_path / "live_strategy.png").exists()
    record = json.loads(out.read_text())
    labels = [Tuner(TunerConfig()).label(i) for i in range(len(TunerConfig().buckets) + 1)]
    narrow, tuned = "tlt_adaptive:off+tree-d2-k2-v3", "tlt_adaptive[buckets=1,4 row_slope=false]"
    for name in ("tlt_off", "tlt_tree-d2-k2-v3", "tlt_adaptive", narrow, tuned):
        row = record["rows"][name]
        assert list(row["bucket_seconds"]) == list(row["bucket_tokens_per_s"]) == labels
        assert 0 < sum(row["bucket_seconds"].values()) <= row["wall_s"]
        assert any(rate is not None and rate > 0 for rate in row["bucket_tokens_per_s"].values())
    ratios = record["ratios"]
    # tlt_off is one of the fixed systems, so the bound is at least 1 (up to the rounding of seconds
    # / (tokens / (tokens / seconds)): it came out 0.9999999999999999 once).
    assert ratios["bucket_bound_vs_off"] >= 1.0 - 1e-9
    assert len(ratios["best_by_bucket"]) == 1  # one repeat
    # The adaptive systems are neither fixed systems nor part of the bound.
    assert set(ratios["best_by_bucket"][0].values()) <= {"tlt_off", "tlt_tree-d2-k2-v3"}
    assert ratios["best_fixed"] in ("tlt_off", "tlt_tree-d2-k2-v3")
    assert ratios["same_samples"] is True  # tree verification draws plain sampling's tokens
    # The narrowed tuner ran over its two arms only; both adaptive systems have their ratios.
    chosen = {a for b in record["rows"][narrow]["tuner"]["buckets"] for a, n in b["choices"].items() if n}
    assert chosen and chosen <= {"off", "tree-d2-k2-v3"}
    assert set(record["rows"][narrow]["tuner"]["buckets"][0]["choices"]) == {"off", "tree-d2-k2-v3"}
    # The tuner of --adaptive-tuner took its settings: three buckets, no row slope.
    assert [b["bucket"] for b in record["rows"][tuned]["tuner"]["buckets"]] == ["1", "2-4", ">4"]
    assert all(b["row_slope"] == 0 for b in record["rows"][tuned]["tuner"]["buckets"])
    assert "paired_vs_off" not in record["rows"]["tlt_off"]
    for key in ("adaptive", "adaptive:off+tree-d2-k2-v3", "adaptive[buckets=1,4 row_slope=false]"):
        assert record["rows"][f"tlt_{key}"]["paired_vs_off"] == pytest.approx(  # one repeat: the plain ratio
            record["rows"]["tlt_off"]["wall_s"] / record["rows"][f"tlt_{key}"]["wall_s"])
        wall = record["rows"][f"tlt_{key}"]["wall_s"]
        assert ratios[f"{key}_vs_off"] == pytest.approx(record["rows"]["tlt_off"]["wall_s"] / wall)
        assert ratios[f"{key}_vs_best_fixed"] == pytest.approx(record["rows"][ratios["best_fixed"]]["wall_s"] / wall)


def test_adaptive_arms_are_checked_before_anything_runs():
    from tlt.bench.rollout import adaptive_arms
    from tlt.errors import ConfigError

    assert adaptive_arms("off, ngram-d4,tree-d4-k2-v8") == ("off", "ngram-d4", "tree-d4-k2-v8")
    with pytest.raises(ConfigError, match=r"--adaptive-arms 'ngram-d4'.*must include 'off'"):
        adaptive_arms("ngram-d4")
    with pytest.raises(ConfigError, match=r"--adaptive-arms 'off,tree-x'"):
        adaptive_arms("off,tree-x")


def test_adaptive_tuner_settings_are_checked_before_anything_runs():
    from tlt.adaptive.tuner import TunerConfig
    from tlt.bench.rollout import adaptive_tuner
    from tlt.errors import ConfigError

    assert adaptive_tuner(" buckets=1,2,64  row_slope=false") == TunerConfig(buckets=(1, 2, 64), row_slope=False)
    for text, message in (("buckets=4,2", "buckets.*strictly increasing"), ("epsilom=0.2", "did you mean 'epsilon'"),
                          ("row_slope", "expected key=value"), ("  ", "one or more KEY=VALUE")):
        with pytest.raises(ConfigError, match=rf"--adaptive-tuner '{text}'.*{message}"):
            adaptive_tuner(text)


def test_dtype_puts_every_system_in_that_dtype(tmp_path, monkeypatch):
    """`--dtype bfloat16`: tlt's engines (target and drafter) and transformers' model all run bf16 weights;
    `--baseline-dtype float32` adds plain decoding in float32, compared in the same run."""
    from tlt.bench import rollout
    from tlt.cli import main

    save_tiny_model_and_drafter(tmp_path)
    seen = []
    run_tlt, run_hf = rollout.run_tlt, rollout.run_hf

    def tlt_spy(model, prompts, args, repeat, config=None, tuner_state=None):
        drafter = None if config is None else config.drafter
        seen.append(("tlt", model.dtype, None if drafter is None else next(drafter.parameters()).dtype))
        return run_tlt(model, prompts, args, repeat, config, tuner_state)

    def hf_spy(hf_model, *args):
        seen.append(("hf", hf_model.dtype, None))
        return run_hf(hf_model, *args)

    monkeypatch.setattr(rollout, "run_tlt", tlt_spy)
    monkeypatch.setattr(rollout, "run_hf", hf_spy)
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--model", str(tmp_path / "model"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", "1", "--samples", "2", "--max-tokens", "6", "--repeats", "1", "--dtype", "bfloat16",
                 "--strategies", "tree-d2-k2-v3", "--adaptive", "--baseline-dtype", "float32", "--json", str(out),
                 "--plot", str(tmp_path / "live.png")]) == 0
    record = json.loads(out.read_text())
    rows, ratios = record["rows"], record["ratios"]
    assert record["config"]["dtype"] == "bfloat16"
    assert set(rows) == {"tlt_off", "tlt_tree-d2-k2-v3", "tlt_adaptive", "hf", "off_float32"}
    assert {kind for kind, _, _ in seen} == {"tlt", "hf"}
    # Each of the 5 systems ran twice (warm-up and one repeat): the float32 baseline's two, the rest bf16.
    assert sorted(str(dtype) for _, dtype, _ in seen) == ["torch.bfloat16"] * 8 + ["torch.float32"] * 2
    assert {drafter for kind, _, drafter in seen if kind == "tlt"} == {None, torch.bfloat16}
    # The float32 baseline is compared with, not counted among the fixed systems or the bound.
    assert ratios["best_fixed"] in ("tlt_off", "tlt_tree-d2-k2-v3") and "bucket_seconds" not in rows["off_float32"]
    base = rows["off_float32"]["wall_s"]
    assert ratios["adaptive_vs_off_float32"] == pytest.approx(base / rows["tlt_adaptive"]["wall_s"])
    assert ratios["tlt_off_vs_off_float32"] == pytest.approx(base / rows["tlt_off"]["wall_s"])
    fastest = min(rows[n]["wall_s"] for n in ("tlt_off", "tlt_tree-d2-k2-v3", "tlt_adaptive"))
    assert ratios["best_vs_off_float32"] == pytest.approx(base / fastest)


def test_fixed_strategies_are_checked_before_anything_runs():
    from tlt.bench.rollout import fixed_strategies
    from tlt.errors import ConfigError

    assert fixed_strategies(" tree-d4-k2-v8,ngram-d4 ,") == ["tree-d4-k2-v8", "ngram-d4"]
    assert fixed_strategies("") == []
    with pytest.raises(ConfigError, match=r"--strategies 'tree-d4-k2-v8,tree-x'.*cannot parse strategy 'tree-x'"):
        fixed_strategies("tree-d4-k2-v8,tree-x")
    with pytest.raises(ConfigError, match=r"--strategies 'off'.*tlt_off"):
        fixed_strategies("off")


def test_drafter_windows_are_checked_before_anything_runs():
    from tlt.bench.rollout import drafter_windows
    from tlt.errors import ConfigError

    assert drafter_windows("") == ["auto"]  # EngineConfig's default
    assert drafter_windows("0, 128,256,auto") == [None, 128, 256, "auto"]
    for bad, why in (("128,x", "'x' is neither auto nor an integer"), ("-4", "'-4' is neither"),
                     ("0,0", "listed twice"), ("auto,auto", "listed twice")):
        with pytest.raises(ConfigError, match=f"--drafter-windows '{bad}'.*{why}"):
            drafter_windows(bad)


def test_several_drafter_windows_run_each_drafter_strategy_once_per_window(tmp_path):
    """Drafter strategies get one system per window (STRATEGY:wW, 0 the whole context), model-free ones
    one; the windows change drafts, never samples."""
    from tlt.cli import main

    save_tiny_model_and_drafter(tmp_path)
    out = tmp_path / "rollout.json"
    code = main(["bench", "rollout", "--model", str(tmp_path / "model"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", "2", "--samples", "2", "--max-tokens", "24", "--repeats", "1", "--skip-hf",
                 "--strategies", "tree-d2-k2-v3,ngram-d2", "--drafter-windows", "0,4",
                 "--json", str(out), "--plot", str(tmp_path / "live.png")])
    assert code == 0
    record = json.loads(out.read_text())
    assert set(record["rows"]) == {"tlt_off", "tlt_tree-d2-k2-v3:w0", "tlt_tree-d2-k2-v3:w4", "tlt_ngram-d2"}
    assert record["config"]["drafter_windows"] == "0,4" and record["config"]["command_line"]  # how it was run
    assert record["config"]["drafter_windows_applied"] == [None, 4]
    assert record["ratios"]["same_samples"] is True


def test_drafter_bits_reach_every_drafting_engine_and_leave_the_samples(tmp_path, monkeypatch):
    """--drafter-bits 4: the fixed and adaptive engines draft on the 4-bit drafter; samples stay plain decoding's."""
    from tlt.cli import main
    from tlt.rollout import RolloutEngine

    seen = []
    original = RolloutEngine.__init__

    def recording(self, model, config=None, **kwargs):
        seen.append((config.drafter is not None, config.drafter_bits))
        original(self, model, config=config, **kwargs)

    monkeypatch.setattr(RolloutEngine, "__init__", recording)
    save_tiny_model_and_drafter(tmp_path)
    out = tmp_path / "rollout.json"
    code = main(["bench", "rollout", "--model", str(tmp_path / "model"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", "2", "--samples", "2", "--max-tokens", "16", "--repeats", "1", "--skip-hf",
                 "--strategies", "tree-d2-k2-v3", "--adaptive", "--drafter-bits", "4",
                 "--json", str(out), "--plot", str(tmp_path / "live.png")])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["config"]["drafter_bits"] == 4 and record["ratios"]["same_samples"] is True
    assert (True, 4) in seen and all(bits == 4 for drafts, bits in seen if drafts)


def test_hf_repeats_runs_transformers_in_the_first_repeats_and_pairs_its_ratios(tmp_path):
    """`--hf-repeats 1` of 2 repeats: transformers runs once, and its ratios pair it with the tlt runs
    of that repeat."""
    from tlt.cli import main

    save_tiny_model_and_drafter(tmp_path)
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--model", str(tmp_path / "model"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", "1", "--samples", "2", "--max-tokens", "6", "--repeats", "2", "--hf-repeats", "1",
                 "--adaptive", "--json", str(out), "--plot", str(tmp_path / "live.png")]) == 0
    record = json.loads(out.read_text())
    rows, ratios = record["rows"], record["ratios"]
    assert len(rows["hf"]["runs_wall_s"]) == 1 and len(rows["tlt_adaptive"]["runs_wall_s"]) == 2
    hf = rows["hf"]["runs_wall_s"][0]
    assert ratios["adaptive_vs_hf"] == pytest.approx(hf / rows["tlt_adaptive"]["runs_wall_s"][0])
    assert ratios["tlt_off_vs_hf"] == pytest.approx(hf / rows["tlt_off"]["runs_wall_s"][0])
    assert rows["hf"]["paired_vs_off"] == pytest.approx(rows["tlt_off"]["runs_wall_s"][0] / hf)
