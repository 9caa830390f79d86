"""The bench policy's recipe and cache (tlt/bench_model.py), the `bench` preset and task; nothing here
trains the bench model: builds run a stand-in command runner."""

from __future__ import annotations

import json

import pytest

from tlt import bench_model
from tlt.errors import CheckpointError, ConfigError
from tlt.model.checkpoint import resolve_model_path
from tlt.sft import PRESETS, SFTConfig, config_from, model_config
from tlt.speculative.drafter import drafter_folder
from tlt.tasks import CharTokenizer, get_task


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bench"


def fake_runner(calls):
    """Stands in for the build commands: records them and writes what the drafter step would."""
    def run(argv, check):
        calls.append(argv)
        if "train-drafter" in argv:
            out = argv[argv.index("--out") + 1]
            (bench_model.Path(out)).mkdir(parents=True, exist_ok=True)
    return run


def test_bench_preset_is_a_qwen3_policy_of_about_100m_parameters():
    c = config_from("bench")
    assert c == SFTConfig(**PRESETS["bench"]) and c.autocast and c.task == "bench"
    m = model_config(c, CharTokenizer())
    per_layer = (m.hidden_size * m.head_dim * (m.num_attention_heads * 2 + m.num_key_value_heads * 2)
                 + 3 * m.hidden_size * m.intermediate_size)
    params = m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size
    assert m.architecture == "Qwen3ForCausalLM" and m.num_hidden_layers >= 12
    assert 85e6 < params < 100e6 and params * 2 >= 128e6  # bf16 bytes
    # the longest bench example (prompt and solution of 192 steps) fits a row and the context
    task = get_task("bench").config
    assert 1000 <= task.max_solution_tokens <= 2000
    assert 1 + 5 + task.width + 2 * task.max_steps + task.max_solution_tokens <= c.row_tokens <= c.max_position_embeddings


def test_preset_fields_yield_to_overrides_and_are_validated(tmp_path):
    assert config_from("bench", overrides=["steps=10", "lr=1e-3"]).steps == 10
    with pytest.raises(ConfigError, match="command line.*row_tokens"):
        config_from("bench", overrides=["row_tokens=1024"])  # too short for the bench task's longest example
    with pytest.raises(ConfigError, match="task"):
        config_from(None, overrides=["task=nope"])


def test_bench_task_is_the_arithmetic_task_with_longer_chains():
    t = get_task("bench")
    assert (t.config.max_steps, t.config.zipf_exponent) == (192, 1.1)
    assert get_task("bench", zipf_exponent=0.9).config.zipf_exponent == 0.9
    steps = sorted(p.num_steps for p in t.sample(2000, seed=0, split="eval"))
    assert steps[len(steps) // 2] < 16 and steps[int(0.99 * len(steps))] > 100  # long-tailed


def test_build_runs_policy_then_drafter_and_is_reused_while_the_recipe_matches(cache, monkeypatch):
    calls = []
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None)
    assert [a[a.index("tlt.cli") + 1] for a in calls] == ["sft", "train-drafter", "train-drafter"]
    assert str(cache) in calls[0] and f"{cache}/drafter" in calls[1]
    # the last stage fine-tunes the first drafter unrolled, into the folder `bench` names as its drafter
    assert calls[2][calls[2].index("--from-drafter") + 1] == f"{cache}/drafter" and "unroll=3" in calls[2]
    assert calls[2][calls[2].index("--out") + 1] == f"{cache}/drafter-unrolled"
    stamp = json.loads((cache / bench_model.STAMP).read_text())
    assert stamp["hash"] == bench_model.recipe_hash(bench_model.recipe()) and len(stamp["commands"]) == 3
    assert not bench_model.build(run=fake_runner(calls), log=lambda *_: None) and len(calls) == 3
    assert resolve_model_path("bench") == cache and drafter_folder("bench") == cache / "drafter-unrolled"
    # a changed recipe is a rebuild, and until then `bench` names the mismatch
    changed = {**PRESETS["bench"], "steps": 221}
    monkeypatch.setitem(PRESETS, "bench", changed)
    with pytest.raises(CheckpointError, match="another recipe.*make bench-model"):
        resolve_model_path("bench")
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None) and len(calls) == 6


def test_the_recipe_records_the_precision_the_policy_trains_in_here(cache, monkeypatch):
    """A policy trained in float32 (no bf16 products on this CPU) is another build than one under bf16 autocast."""
    import tlt.device

    monkeypatch.setattr(tlt.device, "slow_cpu_bf16", lambda: False)
    fast = bench_model.recipe()
    assert "policy_autocast" not in fast  # where the preset's autocast runs the recipe is as it was
    assert bench_model.build(run=fake_runner([]), log=lambda *_: None) and bench_model.is_current(cache)
    monkeypatch.setattr(tlt.device, "slow_cpu_bf16", lambda: True)
    assert bench_model.recipe()["policy_autocast"] is False and not bench_model.is_current(cache)
    assert bench_model.stage_hash(bench_model.recipe(), "policy") != bench_model.stage_hash(fast, "policy")
    with pytest.raises(CheckpointError, match="another recipe"):
        resolve_model_path("bench")


def test_a_changed_drafter_command_keeps_the_policy_and_a_changed_policy_rebuilds_all(cache, monkeypatch):
    calls = []
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None) and len(calls) == 3
    policy, drafter, unrolled = bench_model.COMMANDS
    # the last stage changed: only it runs
    monkeypatch.setattr(bench_model, "COMMANDS", (policy, drafter, (unrolled[0], [*unrolled[1], "steps=301"])))
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None)
    assert len(calls) == 4 and "steps=301" in calls[-1] and "unroll=3" in calls[-1]
    # the first drafter stage changed: both drafter stages run, the policy is kept
    monkeypatch.setattr(bench_model, "COMMANDS", (policy, (drafter[0], [*drafter[1], "steps=301"]), unrolled))
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None)
    assert [a[a.index("tlt.cli") + 1] for a in calls[4:]] == ["train-drafter", "train-drafter"]
    assert "steps=301" in calls[4] and "unroll=3" in calls[5]
    assert bench_model.is_current(cache)
    monkeypatch.setitem(PRESETS, "bench", {**PRESETS["bench"], "steps": 221})
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None)
    assert [a[a.index("tlt.cli") + 1] for a in calls[6:]] == ["sft", "train-drafter", "train-drafter"]


def test_bench_names_make_bench_model_when_missing_or_incomplete(cache):
    with pytest.raises(CheckpointError, match=r"not built: run `make bench-model`"):
        resolve_model_path("bench")
    with pytest.raises(CheckpointError, match="make bench-model"):
        drafter_folder("bench")

    def failing(argv, check):
        if "train-drafter" in argv:
            raise bench_model.subprocess.CalledProcessError(1, argv)

    with pytest.raises(bench_model.subprocess.CalledProcessError):
        bench_model.build(run=failing, log=lambda *_: None)
    with pytest.raises(CheckpointError, match="incomplete.*make bench-model"):
        resolve_model_path("bench")
    # the next build keeps the finished policy stage and runs the two drafter stages only; --force runs all
    calls = []
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None)
    assert [a[a.index("tlt.cli") + 1] for a in calls] == ["train-drafter", "train-drafter"]
    assert [c["name"] for c in json.loads((cache / bench_model.STAMP).read_text())["commands"]] == [
        "policy", "drafter", "unrolled"]
    assert bench_model.build(run=fake_runner(calls), log=lambda *_: None, force=True) and len(calls) == 5


def test_cache_root_follows_tlt_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TLT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bench_model.cache_folder() == tmp_path / "xdg" / "tlt" / "bench"
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "c"))
    assert bench_model.cache_folder() == tmp_path / "c" / "bench"


@pytest.mark.parametrize("slow_bf16", [False, True])
def test_sft_under_bf16_autocast_trains_a_tiny_model_and_records_the_preset(tmp_path, monkeypatch, slow_bf16):
    """Where the CPU has bf16 products autocast trains in bf16; where it has none (AVX2 only: ~40x slower) the run
    says so and trains in float32, and recipe.json records the autocast that ran."""
    import math

    import tlt.device
    from tlt.sft import train_sft

    monkeypatch.setattr(tlt.device, "slow_cpu_bf16", lambda: slow_bf16)

    tiny = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 2048, "steps": 2,
            "warmup_steps": 1, "threads": 1, "log_every": 1, "save_every": 2, "init": None}
    monkeypatch.setitem(PRESETS, "bench", {**PRESETS["bench"], **tiny})
    c = config_from("bench")
    lines = []
    train_sft(c, tmp_path / "m", log=lines.append, preset="bench")
    recipe = json.loads((tmp_path / "m" / "recipe.json").read_text())
    assert recipe["preset"]["name"] == "bench" and recipe["config"]["autocast"] is not slow_bf16
    assert math.isfinite(recipe["metrics"]["loss"]) and "min left" in lines[-1]
    assert any("training in float32" in line for line in lines) == slow_bf16


def test_e2e_model_option_implies_the_bench_policys_task_drafter_and_budget():
    from tlt.bench.e2e import model_defaults
    from tlt.config import build
    from tlt.rl.config import TrainConfig

    assert model_defaults(None) == [] and model_defaults("some/folder") == ["model=some/folder"]
    c = build(TrainConfig, None, [*model_defaults("bench"), "max_response_tokens=900"])
    assert (c.model, c.task, c.drafter.model, c.max_response_tokens) == ("bench", "bench", "bench", 900)
    c = build(TrainConfig, None, model_defaults("bench"))
    assert c.max_response_tokens == get_task("bench").config.max_solution_tokens
