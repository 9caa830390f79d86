"""scripts/compare_drafters.py: paired acceptance lengths of several drafters on one tiny target."""

import json

import pytest

from tlt.errors import ConfigError
from tlt.speculative.drafter import Drafter


def test_drafters_are_compared_on_the_same_samples(tiny_model, tmp_path, script):
    from tlt.tasks import CharTokenizer

    tokenizer = CharTokenizer()
    model = tiny_model(seed=0, vocab_size=32, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    for seed in (0, 1):
        Drafter.from_target(model, seed=seed).save(tmp_path / f"d{seed}")
    out = tmp_path / "cmp.json"
    compare = script("compare_drafters")
    rc = compare.main([str(tmp_path / "d0"), str(tmp_path / "d1"), "--model", str(tmp_path / "model"),
                       "--strategies", "tree-d3-k2-v6,ngram-d4", "--prompts", "3", "--samples", "2",
                       "--max-tokens", "16", "--threads", "1", "--json", str(out)])
    assert rc == 0
    table = json.loads(out.read_text())
    assert [r["drafter"] for r in table["rows"]] == [str(tmp_path / "d0"), str(tmp_path / "d1")]
    assert table["tokens"]["tree-d3-k2-v6"] == table["tokens"]["ngram-d4"] > 0
    d0, d1 = table["rows"]
    assert d0["ngram-d4"] == d1["ngram-d4"]  # the n-gram drafter ignores the learned one
    assert all(1.0 <= r[s] <= 5.0 for r in table["rows"] for s in ("tree-d3-k2-v6", "ngram-d4"))
    with pytest.raises(ConfigError, match="target-only"):
        compare.main([str(tmp_path / "d0"), "--model", str(tmp_path / "model"), "--strategies", "chain-d4"])
