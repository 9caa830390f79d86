"""The engine and its decoders meet only at rollout/decoding.py's `Decoder` protocol.

The engine used to import the speculative decoder that imported it back, probe its decoder with
getattr/hasattr, and keep the speculative decoder's per-row state (n-gram index, text, acceptance
counters) on its own Sequence. These tests keep the seam explicit: every decoder is a Decoder, the
engine module imports no decoder package and probes nothing, and the typed RolloutStats keeps the
engine's stats dict as the benchmarks read it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tlt
from tlt.adaptive import AdaptiveDecoder, Tuner, TunerConfig
from tlt.bench import engine_config
from tlt.model import ModelConfig, Transformer
from tlt.rollout.decoding import Decoder, PlainDecoder
from tlt.rollout.stats import RolloutStats
from tlt.speculative import Drafter, SpeculativeDecoder, Strategy

from random_weights import randomize_

ROLLOUT = Path(tlt.__file__).parent / "rollout"


def random_target(seed=0):
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=61, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, qk_norm=True, eos_token_id=1,
    )).eval()
    return randomize_(model, 0.3)


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import statement of a file, those inside functions too."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, id(node) in top))
    return out


def test_every_decoder_is_a_decoder():
    target = random_target()
    drafter = Drafter.from_target(target, seed=0)
    spec = SpeculativeDecoder(target, drafter, Strategy.parse("tree-d3-k2-v4"))
    decoders = [PlainDecoder(target), SpeculativeDecoder(target, None, Strategy.parse("ngram-d4")), spec,
                AdaptiveDecoder(spec, Tuner(TunerConfig()))]
    for decoder in decoders:
        assert isinstance(decoder, Decoder), type(decoder).__name__
    for system in ("off", "ngram-d4", "tree-d3-k2-v4", "adaptive"):
        engine = tlt.RolloutEngine(target, config=engine_config(system, drafter=drafter, progress=False))
        assert isinstance(engine.decoder, Decoder), system
        assert (engine.tuner is not None) == (system == "adaptive")
        assert engine.drafter is (None if system == "off" else drafter)


def test_a_decoder_missing_a_member_is_not_a_decoder():
    """Guards the test above: the protocol check looks at every member, not just `decode`."""

    class Partial:
        output_layers, drafter, tuner = (), None, None

        def decode(self, batch):
            raise NotImplementedError

    assert not isinstance(Partial(), Decoder)


def test_engine_imports_no_decoder_package():
    for module, _ in imports_of(ROLLOUT / "engine.py"):
        assert not module.startswith(("tlt.speculative", "tlt.adaptive")), module


def test_the_rollout_package_reaches_decoders_only_by_config():
    """Only make_decoder (building the decoder a config names) and EngineConfig's check that a strategy
    has its drafter import a speculative or adaptive module, inside functions: the rollout package
    stays below the decoders in the import graph."""
    allowed = {"decoding.py": {"tlt.speculative.decoder", "tlt.adaptive.decoder"},
               "config.py": {"tlt.speculative.strategy"}}
    for path in sorted(ROLLOUT.glob("*.py")):
        for module, top_level in imports_of(path):
            if module.startswith(("tlt.speculative", "tlt.adaptive")):
                assert not top_level and module in allowed.get(path.name, ()), (path.name, module)


def test_engine_probes_no_decoder_and_reads_no_decoder_state():
    tree = ast.parse((ROLLOUT / "engine.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            assert "decoder" not in ast.unparse(node.args[0]), ast.unparse(node)
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("state", "draft", "ngram", "spec"), ast.unparse(node)


@pytest.mark.parametrize("system", ["off", "ngram-d4", "adaptive"])
def test_decoder_states_are_the_decoders(system):
    """Per-row states come from the decoder: none for plain decoding; under speculation one drafting
    index per group shared by its rows, and acceptance reported per completion."""
    target = random_target(seed=3)
    engine = tlt.RolloutEngine(target, config=engine_config(system, progress=False))
    states = engine.decoder.start([[4, 5, 6], [7, 8]], [2, 3], None)
    assert [len(s) for s in states] == [2, 3]
    if system == "off":
        assert all(s is None for group in states for s in group)
    else:
        assert states[0][0].index is states[0][1].index and states[0][0].index is not states[1][0].index
        assert states[0][0].text == [4, 5, 6] and states[0][0].text is not states[0][1].text
    params = tlt.SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = engine.generate([[4, 5, 6, 4, 5, 6]], params)
    accept = [c.acceptance_length for c in outputs[0].outputs]
    if system == "ngram-d4":
        assert all(a is not None and a >= 1.0 for a in accept)
    elif system == "off":
        assert accept == [None, None]


ENGINE_STATS_KEYS = {"steps", "prefill_tokens", "decode_tokens", "wall_time_s", "mean_step_time_s", "tokens_per_s",
                     "step_times_s", "batch_sizes", "strategies", "step_tokens", "step_drafted", "acceptance_length", "draft_sources"}


def test_engine_stats_keep_their_keys_and_round_trip():
    target = random_target(seed=4)
    engine = tlt.RolloutEngine(target, config=engine_config("ngram-d4", progress=False))
    engine.generate([[4, 5, 6, 4, 5]], tlt.SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True))
    stats = engine.stats()
    assert set(stats) == ENGINE_STATS_KEYS
    assert stats["decode_tokens"] == 20 and stats["steps"] == len(stats["step_times_s"])
    assert RolloutStats.from_dict(stats).as_dict() == stats


def test_rollout_stats_merge():
    a = RolloutStats(2, 5, 9, [0.5, 0.5], [2, 1], ["off", "chain-d4"], [2, 4], 1.0, {"group": [1, 4, 3]})
    b = RolloutStats(1, 3, 3, [2.0], [1], ["suffix-d4"], [3], 2.0, {"group": [1, 3, 2], "prompt": [0, 0, 0]})
    m = RolloutStats.merge([a, b])
    assert (m.steps, m.prefill_tokens, m.decode_tokens, m.wall_time) == (3, 8, 12, 2.0)
    assert m.step_times == [0.5, 0.5, 2.0] and m.strategies == ["off", "chain-d4", "suffix-d4"]
    assert m.sources == {"group": [2, 7, 5], "prompt": [0, 0, 0]}
    d = m.as_dict()
    assert d["tokens_per_s"] == 6.0 and d["mean_step_time_s"] == 1.0 and d["acceptance_length"] == (4 + 3) / 2
    assert a.sources == {"group": [1, 4, 3]}  # the parts are left as they were
    assert RolloutStats.merge([]).as_dict()["tokens_per_s"] == 0.0
