"""`tlt bench history` on a tiny run: both measurements write their figures and commands into one JSON."""

import json

import pytest

from tlt.bench.history import counts, epoch_of
from tlt.rollout.stats import RolloutStats

from rl_fixtures import save_tiny_policy


def test_epochs_and_counts():
    assert [epoch_of(s, 8, 64) for s in (0, 7, 8, 31)] == [1, 1, 2, 4]
    stats = RolloutStats(step_tokens=[3, 8, 2], batch_sizes=[2, 4, 1], strategies=["off", "suffix-d8-v16", "ngram-d4"])
    assert counts(stats) == (10, 5, 0)  # a record made without draft counts counts none
    stats = RolloutStats(step_tokens=[3, 8, 2], batch_sizes=[2, 4, 1], strategies=["off", "suffix-d8-v16", "ngram-d4"],
                         step_drafted=[0, 20, 3])
    assert counts(stats) == (10, 5, 23)
    assert stats.drafted_per_row_step() == {"ngram-d4": 3.0, "suffix-d8-v16": 5.0}
    assert RolloutStats.from_dict(stats.as_dict()).step_drafted == [0, 20, 3]


def test_both_measurements_merge_into_one_json(tmp_path):
    from tlt.cli import main

    model = save_tiny_policy(tmp_path / "model")
    out = tmp_path / "history.json"
    shared = ["--problems", "4", "--epochs", "2", "--prompts-per-step", "2", "--group", "2", "--json", str(out),
              f"model={model}", "drafter.model=none", "reward=reward_fixtures:digit_fraction", "max_response_tokens=16"]
    assert main(["bench", "history", "--measure", "acceptance", "--suffix", "suffix-d8-v16",
                 "--paired", "ngram-d4,suffix-d4-v4", *shared]) == 0
    first = json.loads(out.read_text())
    result = first["acceptance"]
    assert result["same_samples"] and result["steps"] == 4 and [r["epoch"] for r in result["rows"]] == [1, 1, 2, 2]
    assert [r["history_hit_rate"] for r in result["rows"]] == [0.0, 0.0, 1.0, 1.0]
    assert first["acceptance_suffix_vs_ngram"] == result["ratio"] > 0
    assert result["acceptance_epoch_2_on"]["suffix-d8-v16"] / result["acceptance_epoch_2_on"]["ngram-d4"] == \
        result["ratio"]
    assert "history" in result["suffix_sources_epoch_2_on"]
    calibration = result["calibration"]  # the run's engine learned from its suffix drafts' verifications
    assert calibration and all(0 <= row["rate"] <= 1 and row["accepted"] <= row["reached"] for row in calibration)
    by_counts = {(r["count"], r["others"]): r["reached"] for r in calibration if "matched" not in r}
    split = {}  # before any halving, the rows by matched length split each (count, others) row's verifications
    for r in calibration:
        if "matched" in r:
            split[r["count"], r["others"]] = split.get((r["count"], r["others"]), 0) + r["reached"]
    assert split.keys() == by_counts.keys() and all(split[k] == pytest.approx(v, abs=0.2) for k, v in by_counts.items())
    drafted = result["drafted_per_row_step_epoch_2_on"]
    assert 0 < drafted["ngram-d4"] <= 4 and 0 < drafted["suffix-d4-v4"] <= 4 and 0 < drafted["suffix-d8-v16"] <= 16
    assert first["acceptance_command"].startswith("tlt bench history --measure acceptance --problems 4")
    plot = tmp_path / "choices.png"
    assert main(["bench", "history", "--measure", "speedup", "--arms", "suffix-d8-v16", "--plot", str(plot), *shared]) == 0
    assert plot.stat().st_size > 0
    both = json.loads(out.read_text())
    assert both["acceptance"] == result  # the first measurement's figures are kept
    speedup = both["speedup"]
    assert both["speedup_with_suffix_arms"] == speedup["rollout_speedup"] > 0
    assert speedup["arms_added"] == ["suffix-d8-v16"] and "suffix-d8-v16" not in speedup["arms_without"]
    assert speedup["matching_steps"] == 4  # target-only arms: the same samples with and without the new arm
    for name in ("without", "with"):  # where each run's step time went
        assert set(speedup["breakdown_s"][name]) == {"rollout", "reward", "logprob", "update", "sync", "drafter"}
        assert speedup["breakdown_s"][name]["rollout"] == pytest.approx(speedup["rollout_s"][name])
    assert any("suffix-d8-v16" in arms for arms in speedup["choices_by_batch_size_with"].values())
    per_epoch = speedup["choices_by_batch_size_with_by_epoch"]
    assert sorted(per_epoch) == ["1", "2"] and sum(n for e in per_epoch.values() for a in e.values() for n in a.values()) == \
        sum(n for a in speedup["choices_by_batch_size_with"].values() for n in a.values())
    rates = speedup["arm_rates_by_bucket_by_epoch"]["with"]  # what each arm earned in each bucket it ran in
    assert sorted(rates) == ["1", "2"]
    assert sum(arm["steps"] for e in rates.values() for bucket in e.values() for arm in bucket.values()) == \
        sum(n for a in speedup["choices_by_batch_size_with"].values() for n in a.values())
    assert all(arm["tokens_per_s"] == pytest.approx(arm["tokens"] / arm["seconds"])
               for e in rates.values() for bucket in e.values() for arm in bucket.values())
    rollout = speedup["rollout_s_by_step"]
    assert speedup["rollout_speedup_by_epoch"]["2"] == pytest.approx(sum(rollout["without"][2:]) / sum(rollout["with"][2:]))
    assert both["speedup_command"] == ("tlt bench history --measure speedup --problems 4 --epochs 2 "
                                       f"--prompts-per-step 2 --group 2 --arms suffix-d8-v16 model={model} "
                                       "drafter.model=none reward=reward_fixtures:digit_fraction max_response_tokens=16")


def test_acceptance_from_a_cold_start_drafts_with_the_drafter_as_it_learns(tmp_path):
    """drafter.model=random: the drafter starts random and trains on the run's rollouts (drafter.train), and
    the paired learned tree drafts with it as it learns, on the same samples as the suffix drafter."""
    from tlt.cli import main

    model = save_tiny_policy(tmp_path / "model")
    out = tmp_path / "history.json"
    assert main(["bench", "history", "--measure", "acceptance", "--problems", "4", "--epochs", "2",
                 "--prompts-per-step", "2", "--group", "2", "--suffix", "suffix-d8-v16", "--paired",
                 "ngram-d4,tree-d2-k2-v4", "--json", str(out), f"model={model}", "drafter.model=random",
                 "drafter.train=every", "drafter.min_pairs=16", "drafter.holdout=0", "drafter.local_steps=2",
                 "reward=reward_fixtures:digit_fraction", "max_response_tokens=16"]) == 0
    result = json.loads(out.read_text())["acceptance"]
    assert result["same_samples"]
    versions = [r["drafter_version"] for r in result["rows"]]
    assert versions == sorted(versions) and versions[-1] > versions[0]  # it learned during the run
    assert all(r["tree-d2-k2-v4"]["row_steps"] > 0 for r in result["rows"])


def test_buckets_times_plain_decoding_beside_the_drafts(tmp_path):
    from tlt.cli import main

    model = save_tiny_policy(tmp_path / "model")
    out = tmp_path / "history.json"
    assert main(["bench", "history", "--measure", "buckets", "--problems", "4", "--epochs", "2",
                 "--prompts-per-step", "2", "--group", "2", "--suffix", "suffix-d8-v16-p50", "--paired", "ngram-d4",
                 "--json", str(out), f"model={model}", "drafter.model=none",
                 "reward=reward_fixtures:digit_fraction", "max_response_tokens=16"]) == 0
    figures = json.loads(out.read_text())
    result = figures["buckets"]
    assert result["paired"] == ["off", "ngram-d4"] and result["same_samples"] and result["epochs_counted"] == "2 on"
    assert figures["per_bucket_bound_over_off"] == result["per_bucket_bound_over_off"] > 0
    assert figures["buckets_command"].startswith("tlt bench history --measure buckets --problems 4")
    off = result["buckets"]["off"]
    used = {label for label, n in off["tokens"].items() if n}
    assert used and used <= {"1", "2", "3-4"}  # 2 prompts x 2 samples a step: at most 4 live rows
    assert set(result["best_by_bucket"]) == used
    assert set(result["best_by_bucket"].values()) <= {"off", "ngram-d4", "suffix-d8-v16-p50"}
    # every system emitted the same tokens (the same samples), whatever steps it took
    totals = {name: sum(b["tokens"].values()) for name, b in result["buckets"].items()}
    assert len(set(totals.values())) == 1 and totals["off"] > 0
    accepted = result["acceptance_by_step"]  # each system's tokens a row-step, RL step by step
    assert accepted["off"] == [None] * 4 and all(len(v) == 4 and all(x >= 1 for x in v)
                                                   for name, v in accepted.items() if name != "off")
    for name, b in result["buckets"].items():
        assert sum(b["seconds"].values()) == pytest.approx(result["decode_seconds"][name])
        assert result["speedup_over_off"][name] == pytest.approx(result["decode_seconds"]["off"] /
                                                                 result["decode_seconds"][name])


def test_speedup_runs_each_tuner_variant_beside_the_others(tmp_path):
    """`--tuner 'KEY=VALUE ...'` adds a run with the suffix arms under those tuner settings, alternating with the
    other two; each is compared with the run without the arms, on the same samples."""
    from tlt.bench.history import speedup
    from tlt.cli import main
    from tlt.config import build
    from tlt.errors import ConfigError
    from tlt.rl.config import TrainConfig

    model = save_tiny_policy(tmp_path / "model")
    out = tmp_path / "history.json"
    shared = ["--measure", "speedup", "--problems", "2", "--epochs", "2", "--prompts-per-step", "1", "--group", "2",
              "--arms", "suffix-d8-v16", "--json", str(out), f"model={model}", "drafter.model=none",
              "reward=reward_fixtures:digit_fraction", "max_response_tokens=12"]
    assert main(["bench", "history", "--tuner", "score=mean", *shared]) == 0
    figures = json.loads(out.read_text())
    result = figures["speedup"]
    assert set(result["rollout_s"]) == {"without", "with", "with[score=mean]"}
    by_tuner = result["rollout_speedup_by_tuner"]
    assert by_tuner["with"] == result["rollout_speedup"]
    assert by_tuner["with[score=mean]"] == pytest.approx(result["rollout_s"]["without"] /
                                                         result["rollout_s"]["with[score=mean]"])
    assert set(result["rollout_speedup_by_tuner_by_epoch"]["with[score=mean]"]) == {"1", "2"}
    assert result["matching_steps"] == 4  # every run drew the same samples
    assert " --arms suffix-d8-v16 --tuner score=mean " in figures["speedup_command"]
    base = build(TrainConfig, None, [f"model={model}"])
    for bad in (["score=mode"], ["score"], ["score=mean", " score=mean"], ["arms=off"]):
        with pytest.raises(ConfigError, match="--tuner"):
            speedup(base, ("suffix-d8-v16",), bad)


def test_paired_systems_that_cannot_be_compared_are_refused():
    from tlt.bench.history import acceptance, paired_run
    from tlt.errors import ConfigError

    with pytest.raises(ConfigError, match="run's own"):  # the trainer's backend would generate twice a step
        paired_run(None, "suffix-d8-v16", ["off", "suffix-d8-v16"])
    with pytest.raises(ConfigError, match="twice"):
        paired_run(None, "suffix-d8-v16", ["ngram-d4", "ngram-d4"])
    with pytest.raises(ConfigError, match="no acceptance"):
        acceptance(None, "suffix-d8-v16", ["off", "ngram-d4"])
