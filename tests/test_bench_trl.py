"""Smoke test of `tlt bench trl`: TRL's GRPOTrainer runs with its own generation and with tlt's
rollout_func (off and adaptive) on the default model, and the record holds every system's step times."""

import json

import pytest

pytest.importorskip("trl")


def test_trl_bench_runs_every_system_and_writes_the_record(tmp_path, monkeypatch, capsys):
    from tlt.cli import main

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    out = tmp_path / "trl.json"
    assert main(["bench", "trl", "--steps", "2", "--prompts", "2", "--samples", "2", "--max-tokens", "16",
                 "--out", str(tmp_path / "runs"), "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["rows"]) == {"trl", "trl+tlt_off", "trl+tlt"}
    for row in record["rows"].values():
        (run,) = row["runs"]
        assert len(run["step_times_s"]) == 2 and row["steps_timed"] == 1 and row["median_step_s"] > 0
        assert len(run["rewards"]) == 2
    assert record["rows"]["trl+tlt"]["runs"][0]["acceptance_length"] >= 1.0
    assert set(record["ratios"]) == {"trl+tlt_off_vs_trl", "trl+tlt_vs_trl"}
    assert "trl+tlt_vs_trl" in capsys.readouterr().out
    assert main(["bench", "trl", "--steps", "1"]) == 2
