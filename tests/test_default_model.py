"""The committed default model and drafter: quality in the promised range, lossless speculation on it."""

import json

import pytest

import tlt
from tlt.evaluate import evaluate
from tlt.model.checkpoint import BUILTIN_MODELS
from tlt.tasks import ArithmeticTask


@pytest.fixture(scope="module")
def default():
    return tlt.load_model("default"), tlt.load_tokenizer("default")


def test_default_model_is_small_deep_and_reproducible():
    folder = BUILTIN_MODELS["default"]
    recipe = json.loads((folder / "recipe.json").read_text())
    assert recipe["command"].startswith("tlt sft")
    config = tlt.load_config("default")
    assert config.num_hidden_layers >= 8
    assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20
    drafter = json.loads((folder / "drafter" / "drafter_config.json").read_text())
    assert drafter["target_name"] == "default" and drafter["target_layers"] == config.num_hidden_layers


def test_default_accuracy_at_temperature_one_is_between_30_and_80_percent(default):
    model, tokenizer = default
    problems = ArithmeticTask().sample(120, seed=2024, split="eval")
    result = evaluate(model, tokenizer, problems, temperature=1.0, seed=7, progress=False)
    assert 0.30 <= result.accuracy <= 0.80, result.accuracy
    lengths = sorted(result.lengths)
    assert lengths[-1] >= 5 * lengths[len(lengths) // 2]  # the long tail shows in the model's own responses


@pytest.mark.parametrize("drafter", ["default", "random"])
@pytest.mark.parametrize("strategy", ["tree-d6-k4-v24", "chain-d4", "ngram-d4"])
def test_greedy_speculation_on_the_default_model_equals_plain(default, strategy, drafter):
    model, tokenizer = default
    if drafter == "random":
        drafter = tlt.Drafter.from_target(model, seed=0)
    prompts = [p.prompt for p in ArithmeticTask().sample(6, seed=5, split="eval")]
    params = tlt.SamplingParams(temperature=0, max_tokens=300)
    plain = tlt.RolloutEngine(model, tokenizer).generate(prompts, params)
    engine = tlt.RolloutEngine(model, tokenizer, tlt.EngineConfig(speculative="on", strategy=strategy, drafter=drafter))
    spec = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    if strategy.startswith("tree") and drafter == "default":
        assert engine.stats()["acceptance_length"] >= 2.0  # the committed drafter is really trained


def test_response_lengths_have_the_same_distribution_with_speculation(default):
    """Chain speculative sampling (min(1, p/q)) is exact in distribution, not token for token: compare
    response lengths of independent runs on and off with a two-sample KS test."""
    from scipy.stats import ks_2samp

    model, tokenizer = default
    prompts = [p.prompt for p in ArithmeticTask().sample(25, seed=9, split="eval")]

    def lengths(config, seed):
        engine = tlt.RolloutEngine(model, tokenizer, config)
        out = engine.generate(prompts, [tlt.SamplingParams(n=8, temperature=1.0, max_tokens=640, seed=seed + i)
                                        for i in range(len(prompts))])
        return [len(c.token_ids) for o in out for c in o.outputs]

    off = lengths(tlt.EngineConfig(), seed=0)
    on = lengths(tlt.EngineConfig(speculative="on", strategy="chain-d4", drafter="default"), seed=10_000)
    assert ks_2samp(off, on).pvalue > 0.001
