"""Generation stops on the eos ids of a folder's generation_config.json as well as config.json's."""

import json

import pytest

import tlt


def _write_generation_eos(folder, eos):
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = eos
    path.write_text(json.dumps(config))


def test_eos_of_generation_config_is_added_after_config_eos(hf_folder):
    _, folder = hf_folder("qwen2")
    _write_generation_eos(folder, [2, 11, 13])
    model = tlt.load_model(folder)
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    assert model.config.eos_token_ids == [2, 11, 13]
    assert tlt.RolloutEngine(model).eos_ids == frozenset({2, 11, 13})


def test_generation_stops_on_an_eos_only_generation_config_declares(hf_folder):
    """A chat model whose end-of-turn token is declared only in generation_config.json used to run on
    past it to the length limit."""
    _, folder = hf_folder("llama", seed=3)
    prompt = [1, 5, 9, 14]
    greedy = tlt.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = tlt.RolloutEngine(tlt.load_model(folder)).generate([prompt], greedy)[0].outputs[0].token_ids
    # A token first seen at position >= 2 with no eos (2) before it: the run must end right there.
    stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i] + [2] and 2 not in free[:i])
    _write_generation_eos(folder, stop)
    engine = tlt.RolloutEngine(tlt.load_model(folder))
    out = engine.generate([prompt], tlt.SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: free.index(stop) + 1]


@pytest.mark.parametrize("eos", ["2", [2, None], True, -1])
def test_bad_generation_config_eos_names_the_file(hf_folder, eos):
    _, folder = hf_folder("qwen2")
    _write_generation_eos(folder, eos)
    with pytest.raises(tlt.ConfigError, match="generation_config.json.*eos_token_id"):
        tlt.load_model(folder)


def test_folder_without_generation_config_keeps_config_eos(hf_folder):
    _, folder = hf_folder("qwen2")
    (folder / "generation_config.json").unlink()
    assert tlt.load_model(folder).config.eos_token_ids == [2]
