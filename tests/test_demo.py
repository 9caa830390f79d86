"""`tlt demo` on a tiny model: both runs stepped in turn, the speed-up and sample agreement printed, and
the tlt run's report drawn against the off run."""

import json

from tlt.cli import main

from rl_fixtures import save_tiny_policy


def test_demo_runs_off_and_tlt_side_by_side(tmp_path, capsys):
    model = save_tiny_policy(tmp_path / "model")
    tiny = [f"model={model}", "drafter.model=none", "tuner.arms=off,ngram-d4", "workers=1",
            "reward=reward_fixtures:digit_fraction", "train_problems=16", "prompts_per_step=2", "group_size=2",
            "max_response_tokens=8", "eval.problems=2", "eval.samples=2"]
    assert main(["demo", "--steps", "2", "--out", str(tmp_path / "demo"), *tiny]) == 0
    out = capsys.readouterr().out
    assert "end-to-end speed-up over speculation off:" in out
    assert "in 2 of 2 steps: tlt's default arms verify target-only" in out  # ngram-d4 draws plain decoding's samples
    for name in ("off", "tlt"):
        rows = [json.loads(x) for x in (tmp_path / "demo" / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[0] and "eval_accuracy" in rows[2]
        assert json.loads((tmp_path / "demo" / name / "config.json").read_text())["speculative"] == \
            {"off": "off", "tlt": "adaptive"}[name]
    assert (tmp_path / "demo" / "tlt" / "report" / "report.md").exists()
