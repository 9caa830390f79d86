"""`tlt bench rollout`: where the time goes by live batch size, and the best-per-bucket bound, by hand
and in a tiny run of the command."""

import json

import pytest
import torch

from tlt.adaptive.tuner import Tuner, TunerConfig
from tlt.bench.rollout import bucket_bound, bucket_seconds


def test_bucket_seconds_sums_steps_into_the_tuners_buckets():
    tuner = Tuner(TunerConfig(buckets=(1, 4)))
    split = bucket_seconds([0.5, 0.25, 0.125, 1.0, 2.0], [9, 4, 3, 1, 1], tuner)
    assert split == {"1": 3.0, "2-4": 0.375, ">4": 0.5}


def test_bucket_bound_takes_the_fastest_fixed_system_in_each_bucket():
    rows = {"tlt_off": {"bucket_seconds": {"1": 4.0, ">1": 2.0}},
            "tlt_tree": {"bucket_seconds": {"1": 2.0, ">1": 3.0}},
            "tlt_ngram": {"bucket_seconds": {"1": 1.0, ">1": 5.0}}}
    bound, best = bucket_bound(rows, ["tlt_off", "tlt_tree", "tlt_ngram"])
    assert best == {"1": "tlt_ngram", ">1": "tlt_off"}
    assert bound == pytest.approx(6.0 / 3.0)


def test_the_command_records_bucket_seconds_and_the_bound(tmp_path):
    """A tiny random model with the built-in tokenizer: off, one tree and adaptive, one repeat."""
    from tlt.cli import main
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
    out = tmp_path / "rollout.json"
    code = main(["bench", "rollout", "--model", str(tmp_path / "model"), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", "2", "--samples", "3", "--max-tokens", "12", "--repeats", "1", "--skip-hf",
                 "--strategies", "tree-d2-k2-v3", "--adaptive", "--json", str(out),
                 "--plot", str(tmp_path / "live.png")])
    assert code == 0
    record = json.loads(out.read_text())
    labels = [Tuner(TunerConfig()).label(i) for i in range(len(TunerConfig().buckets) + 1)]
    for name in ("tlt_off", "tlt_tree-d2-k2-v3", "tlt_adaptive"):
        split = record["rows"][name]["bucket_seconds"]
        assert list(split) == labels
        assert 0 < sum(split.values()) <= record["rows"][name]["wall_s"]
    ratios = record["ratios"]
    assert ratios["bucket_bound_vs_off"] >= 1.0  # tlt_off is one of the fixed systems
    assert set(ratios["best_by_bucket"].values()) <= {"tlt_off", "tlt_tree-d2-k2-v3"}
    assert ratios["same_samples"] is True  # tree verification draws plain sampling's tokens
