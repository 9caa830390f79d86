"""TrainConfig's keys: a component's group set by dotted keys or nested YAML, the flat keys of the
previous release still accepted with a warning naming the new key, errors naming the dotted key and
its origin, and `tlt train --help-config` listing every key with its default."""

import warnings

import pytest

from tlt.cli import main
from tlt.config import build, flatten, format_value, from_dict, keys, load_yaml, override, to_dict, upgrade
from tlt.errors import ConfigError
from tlt.rl import TrainConfig


def test_dotted_keys_and_nested_yaml_set_a_groups_fields(tmp_path):
    (tmp_path / "run.yaml").write_text("steps: 3\ndrafter: {lr: 1.0e-3, train: every}\nloss:\n  kl_coef: 0.05\n")
    c = build(TrainConfig, tmp_path / "run.yaml", ["drafter.lr=2e-4", "tuner.arms=off,tree-d4-k2-v8",
                                                     "history.responses=0", "optim.mini_batches=2", "eval.every=5",
                                                     "log.wandb=true"])
    assert (c.steps, c.drafter.lr, c.drafter.train, c.loss.kl_coef) == (3, 2e-4, "every", 0.05)
    assert c.tuner.arms == ("off", "tree-d4-k2-v8") and c.history.responses == 0 and c.optim.mini_batches == 2
    assert c.eval.every == 5 and c.log.wandb is True
    assert c.drafter.window == 256 and c.tuner.epsilon == 0.1  # the rest of each group keeps its defaults
    assert from_dict(TrainConfig, to_dict(c)) == c  # config.json's nested layout reads back


def test_a_flat_key_of_an_earlier_release_warns_naming_its_new_key(tmp_path):
    with pytest.warns(FutureWarning) as caught:
        c = build(TrainConfig, None, ["drafter_lr=1e-4", "drafter=random", "eval_every=5", "wandb=true"])
    assert c.drafter.lr == 1e-4 and c.drafter.model == "random" and c.eval.every == 5 and c.log.wandb is True
    assert [str(w.message) for w in caught] == [
        "command line: key 'drafter_lr' is now 'drafter.lr'; the old name goes in the next release",
        "command line: key 'drafter' is now 'drafter.model'; the old name goes in the next release",
        "command line: key 'eval_every' is now 'eval.every'; the old name goes in the next release",
        "command line: key 'wandb' is now 'log.wandb'; the old name goes in the next release"]
    (tmp_path / "run.yaml").write_text("lr: 0.001\ntuner_arms: off,ngram-d4\n")
    with pytest.warns(FutureWarning) as caught:
        c = build(TrainConfig, tmp_path / "run.yaml", ["optim.lr=0.01"])  # the command line still wins
    assert c.optim.lr == 0.01 and c.tuner.arms == ("off", "ngram-d4")
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        "key 'lr' is now 'optim.lr'; the old name goes in the next release",
        "key 'tuner_arms' is now 'tuner.arms'; the old name goes in the next release"]
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="'optim.lr' is given twice"):
        from_dict(TrainConfig, {"lr": "0.1", "optim.lr": "0.2"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new keys warn about nothing
        build(TrainConfig, None, ["optim.lr=0.1", "drafter.model=random", "eval.problems=8", "log.progress=false"])


def test_a_config_json_of_the_release_before_the_eval_and_log_groups_reads_back():
    """config.json as the release before `eval.` and `log.` wrote it (the other groups nested, eval_every,
    wandb, ... flat) reads back as the same config, without a warning: tlt wrote those keys."""
    nested = to_dict(override(TrainConfig(), {"eval.every": 5, "eval.samples": 2, "log.wandb_project": "p",
                                              "log.progress": False}))
    old = {k: v for k, v in nested.items() if k not in ("eval", "log")}
    old.update({f"eval_{k}": v for k, v in nested["eval"].items()}, **nested["log"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_dict(TrainConfig, upgrade(TrainConfig, old)) == from_dict(TrainConfig, nested)


def test_an_unknown_key_names_the_closest_dotted_key():
    for given, closest in (("tuner.arm", "tuner.arms"), ("drafter.lrr", "drafter.lr"), ("tunr.epsilon", "tuner.epsilon"),
                           ("tuner_window", "tuner.window")):  # tuner_window was never a flat key
        with pytest.raises(ConfigError, match=rf"^command line: unknown field '{given}'.*did you mean '{closest}'"):
            build(TrainConfig, None, [f"{given}=1"])


def test_a_bad_value_in_a_group_names_the_dotted_key_and_its_origin(tmp_path):
    (tmp_path / "run.yaml").write_text("drafter: {lr: 0}\n")
    with pytest.raises(ConfigError, match=r"run.yaml: field 'drafter.lr' must be > 0, got 0"):
        build(TrainConfig, tmp_path / "run.yaml")
    with pytest.raises(ConfigError, match=r"^command line: field 'tuner.epsilon': expected float, got 'lots'"):
        build(TrainConfig, tmp_path / "run.yaml", ["tuner.epsilon=lots"])
    with pytest.raises(ConfigError, match=r"^command line: field 'drafter.batch_tokens' must be at least rows \* window"):
        build(TrainConfig, None, ["drafter.window=4096"])  # a default blamed on the key that broke it
    with pytest.raises(ConfigError, match=r"field 'drafter' must be a SpotConfig \(set its keys as drafter.NAME\)"):
        TrainConfig(drafter="random")  # in Python, a group takes its component's config


def test_help_config_lists_every_key_with_its_default(capsys):
    assert main(["train", "--help-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    defaults = flatten(to_dict(TrainConfig()))
    assert set(defaults) == set(keys(TrainConfig)) and len(defaults) > 90
    for key, default in defaults.items():
        line = next((x for x in lines if x.startswith(f"{key}=")), None)
        assert line is not None, key
        assert line.split()[0] == f"{key}={format_value(default)}" and len(line.split()) > 1, line  # and a meaning
    assert "drafter.*: the learned drafter and its online training on released workers" in lines


def test_a_yaml_file_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    """Regression: a binary file gave a UnicodeDecodeError traceback, a folder was "missing", and a
    syntax error's message ran over several lines quoting "<unicode string>"."""
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00steps")
    with pytest.raises(ConfigError, match=r"binary.yaml: not a UTF-8 text file \(invalid start byte at byte 0\)"):
        build(TrainConfig, tmp_path / "binary.yaml")
    with pytest.raises(ConfigError, match=r": is a folder; expected a YAML config file"):
        build(TrainConfig, tmp_path)
    (tmp_path / "bad.yaml").write_text("steps: 2\n  group_size: [2\n")
    with pytest.raises(ConfigError) as caught:
        build(TrainConfig, tmp_path / "bad.yaml")
    assert str(caught.value) == f"{tmp_path / 'bad.yaml'}: line 2, column 13: invalid YAML (mapping values are not allowed here)"
    (tmp_path / "two.yaml").write_text("steps: 1\n---\nsteps: 2\n")
    with pytest.raises(ConfigError, match=r"two.yaml: line 2, column 1: invalid YAML \(expected a single document"):
        build(TrainConfig, tmp_path / "two.yaml")
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbfsteps: 3\n")  # a byte-order mark (Windows editors) is read past
    assert build(TrainConfig, tmp_path / "bom.yaml").steps == 3


def test_a_group_given_a_value_of_its_own_names_its_keys(tmp_path):
    """Regression: `eval=3` or YAML `eval: null` said "no field has a similar name" for a group that exists."""
    with pytest.raises(ConfigError, match=r"^command line: 'eval' is a group of fields, not a field: set its keys as "
                                          r"eval.NAME \(eval.every, eval.problems, eval.samples\)$"):
        build(TrainConfig, None, ["eval=3"])
    (tmp_path / "run.yaml").write_text("optim: null\n")
    with pytest.raises(ConfigError, match=r"run.yaml: 'optim' is a group .* \(optim.beta1, optim.beta2, optim.grad_clip, ...\)"):
        build(TrainConfig, tmp_path / "run.yaml")


@pytest.mark.parametrize("yaml_text, override, message", [
    ("dataset: [a.jsonl, b.jsonl]\n", None, r"run.yaml: field 'dataset': expected a string, got \['a.jsonl', 'b.jsonl'\]"),
    ("model: null\n", None, "run.yaml: field 'model': expected a string, got None"),
    ("reward: [math]\n", None, r"run.yaml: field 'reward': expected a string, got \['math'\]"),
    (None, "dataset=", "command line: field 'dataset' must be a file path or none, got ''"),
    (None, "eval_dataset= ", "command line: field 'eval_dataset' must be a file path or none, got ''"),
    (None, "model=", "command line: field 'model' must be a model folder or a built-in name, got ''"),
    (None, "task=arithmetc", r"command line: field 'task' must be one of \('arithmetic', 'bench'\), got 'arithmetc'"),
])
def test_a_value_that_is_not_a_name_is_refused(tmp_path, yaml_text, override, message):
    """Regression: YAML `dataset: [a, b]` became the path "['a', 'b']" and `model: null` the folder "None";
    `dataset=` (an unset shell variable) silently trained on the built-in task instead; `task=nosuch`
    ended in a ValueError traceback."""
    if yaml_text is not None:
        (tmp_path / "run.yaml").write_text(yaml_text)
    with pytest.raises(ConfigError, match=f"(^|/){message}$"):
        build(TrainConfig, tmp_path / "run.yaml" if yaml_text else None, [override] if override else [])


def test_yaml_off_and_on_are_words_not_booleans(tmp_path):
    """Regression: PyYAML read `speculative: off` (the README's speculative=off, as YAML) as False, which
    failed as "must be one of ('off', 'on', 'adaptive'), got 'False'"; so did `arms: [off, ngram-d4]`."""
    (tmp_path / "run.yaml").write_text("speculative: off\ntuner: {arms: [off, ngram-d4]}\n"
                                       "log: {wandb: yes, tensorboard: True}\nloss: {normalize_std: off}\n")
    c = build(TrainConfig, tmp_path / "run.yaml")
    assert c.speculative == "off" and c.tuner.arms == ("off", "ngram-d4")
    assert c.log.wandb is True and c.log.tensorboard is True and c.loss.normalize_std is False


def test_a_field_set_twice_in_yaml_is_named_with_both_lines(tmp_path):
    """Regression: PyYAML keeps the last of two equal keys, so `steps: 2` above a forgotten `steps: 50`
    trained for 50 steps without a word. A key that overrides a merged anchor (`<<: *base`) is meant."""
    (tmp_path / "run.yaml").write_text("steps: 2\nloss:\n  tis_cap: 2.0\n  clip: 0.2\n  tis_cap: 3.0\n")
    with pytest.raises(ConfigError) as caught:
        build(TrainConfig, tmp_path / "run.yaml")
    assert str(caught.value) == (f"{tmp_path / 'run.yaml'}: line 5, column 3: invalid YAML "
                                 "(duplicate key 'tis_cap', first set on line 3)")
    (tmp_path / "merged.yaml").write_text("defaults: &base\n  tis_cap: 2.0\n  clip: 0.2\n"
                                          "loss:\n  <<: *base\n  tis_cap: 3.0\n")
    assert load_yaml(tmp_path / "merged.yaml")["loss"] == {"tis_cap": 3.0, "clip": 0.2}


def test_a_field_given_as_a_dotted_key_and_inside_its_group_is_refused(tmp_path):
    """Regression: `loss.clip_low: 0.1` beside `loss: {clip_low: 0.3}` kept whichever came last, and so did a
    group written twice (`loss: {a}` ... `loss: {b}` dropped a). Keys that override what a merge brings, even
    through merges of merges, are meant; an unhashable key keeps PyYAML's own error."""
    cases = {
        "dotted.yaml": ("loss.clip_low: 0.1\nloss:\n  clip_low: 0.3\n",
                        "line 3, column 3: invalid YAML ('loss.clip_low' is set twice, as a dotted key and inside its "
                        "group, first on line 1)"),
        "groups.yaml": ("loss: {clip_low: 0.1}\nsteps: 2\nloss: {clip_high: 0.3}\n",
                        "line 3, column 1: invalid YAML (duplicate key 'loss', first set on line 1)"),
        "unhashable.yaml": ("? [a, b]\n: 1\n", "line 1, column 3: invalid YAML (while constructing a mapping found "
                                                "unhashable key)"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_yaml(tmp_path / name)
        assert str(caught.value) == f"{tmp_path / name}: {message}"
    (tmp_path / "chained.yaml").write_text("common: &common {clip_low: 0.2, clip_high: 0.3}\npresets:\n"
                                           "  strict: &strict\n    <<: *common\n    clip_low: 0.1\nloss:\n  <<: *strict\n")
    assert load_yaml(tmp_path / "chained.yaml")["loss"] == {"clip_low": 0.1, "clip_high": 0.3}
    (tmp_path / "top.yaml").write_text("base: &base\n  loss: {clip_low: 0.2}\n<<: *base\nloss.clip_low: 0.3\n")
    assert {k: v for k, v in load_yaml(tmp_path / "top.yaml").items() if k != "base"} == {
        "loss": {"clip_low": 0.2}, "loss.clip_low": 0.3}
