"""Bad input a user brings to a run beyond one file or one value: an eval file whose columns differ
from the training file's, a reward whose parameters the dataset's columns do not fit, a timeout that
cannot apply, a resume with another model or with no checkpoint, a checkpoint whose save fails
half-way (the previous one must survive whole), a torn config.json under `tlt report`, a file given as
the run directory or as its checkpoints folder, an --out that holds checkpoints, and a policy folder
given as the drafter."""

import json

import pytest

import tlt.rl.checkpoint
from tlt.cli import main
from tlt.errors import CheckpointError, ConfigError
from tlt.rl import GRPOTrainer
from tlt.rl.checkpoint import read_checkpoint
from tlt.rl.run import train

from rl_fixtures import save_tiny_policy, tiny_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("bad-inputs-model"))


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def steps_in(run) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_eval_rows_without_the_training_columns_are_named_at_start(model_dir, tmp_path):
    """Regression: an eval file with `solution` where the training file has `answer` started without a
    word; every eval then scored 0 for a reward that reads `answer`. A missing eval file was reported
    as "dataset ...", naming the wrong setting."""
    train_file = write_rows(tmp_path / "train.jsonl", [{"prompt": f"Q:{i}+1\nA:", "answer": str(i + 1)} for i in range(8)])
    eval_file = write_rows(tmp_path / "eval.jsonl", [{"prompt": "Q:2+2\nA:", "solution": "4"}])
    lines = []
    GRPOTrainer(tiny_config(model_dir, dataset=train_file, eval_dataset=eval_file, eval={"every": 1}),
                log=lines.append).close()
    assert any(x.startswith(f"warning: eval_dataset {eval_file} lacks the column(s) ['answer'] that every row of "
                            f"{train_file} has (first: {eval_file}:1)") for x in lines), lines
    with pytest.raises(ConfigError, match=r"^eval_dataset .*missing.jsonl: no such file$"):
        GRPOTrainer(tiny_config(model_dir, dataset=train_file, eval_dataset=str(tmp_path / "missing.jsonl")),
                    log=lambda *_: None)


def test_resume_with_another_model_fails_at_once_and_writes_nothing(model_dir, tmp_path, capsys):
    """Regression: resuming with `model=` of another size tried every checkpoint as if torn ("cannot
    resume from ..."), then said none "can be read" and advised restoring the checkpoints folder."""
    run = tmp_path / "run"
    train(tiny_config(model_dir, steps=2, save_every=1), run, log=lambda *_: None)
    other = save_tiny_policy(tmp_path / "other", intermediate_size=48)
    saved = {name: (run / name).read_text() for name in ("config.json", "metrics.jsonl")}
    assert main(["train", "--resume", str(run), f"model={other}", "steps=3"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()[-1]
    assert err.startswith(f"tlt train: error: {run / 'checkpoints' / 'step_00000002' / 'policy'}: the run's weights "
                          f"do not fit model={other} (other shape (saved vs model) ['model.layers.0.mlp.down_proj.weight "
                          "(32, 64) vs (32, 48)'"), err
    assert "resume with the model the run was started with" in err and "cannot resume from" not in captured.out
    assert {name: (run / name).read_text() for name in saved} == saved


def test_resume_without_a_checkpoint_says_it_starts_again(model_dir, tmp_path):
    """Regression: resuming a run that had no checkpoint (save_every=0) restarted it from step 0 silently."""
    run = tmp_path / "run"
    config = tiny_config(model_dir, steps=1, save_every=0)
    train(config, run, log=lambda *_: None)
    lines = []
    train(config, run, resume=True, log=lines.append)
    assert lines[0] == f"warning: {run} has no checkpoint (none written yet, or save_every=0): the run starts again from step 0"
    assert steps_in(run) == [1]


def test_a_save_that_fails_half_way_keeps_the_previous_checkpoint(model_dir, tmp_path, monkeypatch):
    """A save that raises inside the new checkpoint's folder (a full disk) leaves the previous checkpoint
    whole and named by latest.json, even with keep_checkpoints=1, and no temporary folder; resume then
    runs the lost step again, once."""
    run = tmp_path / "run"
    config = tiny_config(model_dir, steps=2, save_every=1, keep_checkpoints=1)
    write_bytes = tlt.rl.checkpoint.atomic_write_bytes

    def disk_full(path, data):
        if "step_00000002" in str(path) and path.name == "trainer_state.pt":
            path.write_bytes(data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        write_bytes(path, data)

    monkeypatch.setattr(tlt.rl.checkpoint, "atomic_write_bytes", disk_full)
    with pytest.raises(CheckpointError) as info:  # regression: an OSError traceback naming no checkpoint
        train(config, run, log=lambda *_: None)
    assert str(info.value) == (f"{run / 'checkpoints' / 'step_00000002'}: cannot save the checkpoint of step 2 "
                               "([Errno 28] No space left on device); the previous checkpoint, step_00000001, is "
                               f"kept; free space (or fix the disk) and continue with tlt train --resume {run}")
    monkeypatch.setattr(tlt.rl.checkpoint, "atomic_write_bytes", write_bytes)
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest.json", "step_00000001"]
    assert json.loads((checkpoints / "latest.json").read_text()) == {"step": 1, "dir": "step_00000001"}
    assert read_checkpoint(checkpoints / "step_00000001").state.step == 1
    train(config, run, resume=True, log=lambda *_: None)
    assert steps_in(run) == [1, 2]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest.json", "step_00000002"]


def test_report_on_a_run_with_a_torn_config_json_is_one_line(model_dir, tmp_path, capsys):
    """Regression: `tlt report` on a run whose config.json was cut short ended in a JSONDecodeError traceback."""
    run = tmp_path / "run"
    train(tiny_config(model_dir, steps=1), run, log=lambda *_: None)
    (run / "config.json").write_text((run / "config.json").read_text()[:30])
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith(f"tlt report: error: {run / 'config.json'}: line ")


def test_an_output_path_that_is_a_file_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    """Regression: `tlt train --out FILE` loaded the model, then ended in a FileExistsError traceback."""
    import tlt.model

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the output folder was checked")

    monkeypatch.setattr(tlt.model, "load_model", no_weights)
    (tmp_path / "out").write_text("notes\n")
    with pytest.raises(ConfigError, match=r"out: is a file; a run directory is a folder"):
        train(tiny_config(model_dir), tmp_path / "out", log=lambda *_: None)
    assert (tmp_path / "out").read_text() == "notes\n"


def test_a_model_folder_given_as_the_drafter_is_named_as_such(model_dir):
    """Regression: `drafter.model=` naming the policy's own folder said only "drafter_config.json: file is
    missing", naming neither the setting nor what the folder is."""
    config = tiny_config(model_dir, speculative="on", strategy="chain-d2", drafter={"model": str(model_dir)})
    with pytest.raises(ConfigError, match=r"^field 'drafter.model' .*: the folder has no drafter_config.json \(it "
                                          r"holds a model: a policy, not a drafter\); give a drafter folder"):
        GRPOTrainer(config, log=lambda *_: None)


@pytest.fixture
def no_weights(monkeypatch):
    """Make loading weights fail the test: what is refused at start must be refused before they load."""
    import tlt.model

    def load_model(*args, **kwargs):
        raise AssertionError("weights loaded before the check")

    monkeypatch.setattr(tlt.model, "load_model", load_model)


def test_a_checkpoints_file_in_the_run_directory_is_refused_at_start(model_dir, tmp_path, no_weights):
    """Regression: a file named `checkpoints` ended the run at its first save, a step in, with a
    FileExistsError traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("notes\n")
    for resume, advice in ((False, ", or pick another --out"), (True, "")):
        with pytest.raises(ConfigError) as info:
            train(tiny_config(model_dir), run, resume=resume, log=lambda *_: None)
        assert str(info.value) == (f"{run / 'checkpoints'}: is a file; a run keeps its checkpoints in a folder of "
                                   f"that name (move or rename the file{advice})")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


def test_a_new_run_in_a_directory_holding_checkpoints_is_refused(model_dir, tmp_path, no_weights):
    """Regression: only metrics.jsonl marked a run, so a directory holding checkpoints but no metrics
    took a new run whose step folders overwrote the old ones."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "latest.json").write_text('{"step": 1, "dir": "step_00000001"}\n')
    with pytest.raises(ConfigError) as info:
        train(tiny_config(model_dir), run, log=lambda *_: None)
    assert str(info.value) == (f"{run} already holds checkpoints ({run / 'checkpoints'}); continue that run with "
                               f"--resume {run} or pick another --out")
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints", "latest.json", "step_00000001"]


@pytest.mark.parametrize("reward, message", [
    ("reward_fixtures:weighted_answer", "reward 'reward_fixtures:weighted_answer' needs the column(s) ['weight'] "
                                        "(parameters without a default), which no row of {file} has; its columns "
                                        "are ['answer', 'level']"),
    ("arithmetic", "reward 'arithmetic' needs the column(s) ['answer']"),
    ("reward_fixtures:answer_only", "reward 'reward_fixtures:answer_only' has no parameter for the column(s) "
                                    "['level'] of {file}, and every column is passed by keyword; add **kwargs"),
])
def test_a_reward_the_columns_do_not_fit_is_refused_at_start(model_dir, tmp_path, no_weights, reward, message):
    """Regression: a reward's required parameter that no row had (or a column a reward without **kwargs
    cannot take) failed every row from the first step, until reward_failure_steps stopped the run."""
    rows = [{"prompt": f"Q:{i}+1\nA:", "answer": str(i + 1), "level": 1} for i in range(8)]
    if reward == "arithmetic":
        rows = [{"prompt": r["prompt"], "solution": r["answer"]} for r in rows]
    data = write_rows(tmp_path / "train.jsonl", rows)
    with pytest.raises(ConfigError) as info:
        GRPOTrainer(tiny_config(model_dir, dataset=data, reward=reward), log=lambda *_: None)
    assert message.format(file=data) in str(info.value)


def test_an_eval_file_the_reward_cannot_score_is_refused_at_start_even_without_periodic_eval(model_dir, tmp_path,
                                                                                              no_weights):
    """Side-by-side runs evaluate at their start and end whatever eval.every says, so the eval file's columns are
    checked against the reward whenever one is named."""
    rows = [{"prompt": f"Q:{i}+1\nA:", "answer": str(i + 1)} for i in range(8)]
    data = write_rows(tmp_path / "train.jsonl", rows)
    held = write_rows(tmp_path / "eval.jsonl", [{"prompt": r["prompt"]} for r in rows])
    with pytest.raises(ConfigError) as info:
        GRPOTrainer(tiny_config(model_dir, dataset=data, eval_dataset=held, reward="arithmetic"), log=lambda *_: None)
    assert f"reward 'arithmetic' needs the column(s) ['answer'] (parameters without a default), which no row of {held}" \
        in str(info.value)


def test_a_reward_timeout_without_reward_workers_is_warned_about_once(model_dir, tmp_path):
    """Regression: reward_timeout_s did nothing with reward_workers=0 (in-process calls cannot be
    stopped), without a word."""
    for timeout, expected in ((30.0, []), (5.0, [
            "warning: reward_timeout_s=5 has no effect with reward_workers=0: the reward runs in the training "
            "process, where a call that hangs cannot be stopped; set reward_workers=1 or more to limit each call to "
            "reward_timeout_s seconds"])):
        lines = []
        GRPOTrainer(tiny_config(model_dir, reward_timeout_s=timeout), log=lines.append).close()
        assert [x for x in lines if "reward_timeout_s" in x] == expected


def test_an_openrlhf_file_plugs_in_by_its_prompt_and_label_columns(model_dir, tmp_path):
    """OpenRLHF's prompt data is `input` and `label` columns: `prompt_column=input` and
    `reward_columns=label:answer` give the built-in reward its `answer`, in training and eval rows alike;
    a renamed column the row also has under the new name, and a malformed entry, are named."""
    rows = [{"input": f"Q:{i}+1\nA:", "label": str(i + 1)} for i in range(8)]
    data = write_rows(tmp_path / "train.jsonl", rows)
    held = write_rows(tmp_path / "eval.jsonl", rows[:2])
    trainer = GRPOTrainer(tiny_config(model_dir, dataset=data, eval_dataset=held, prompt_column="input",
                                      reward_columns=("label:answer",), reward="arithmetic"), log=lambda *_: None)
    try:
        assert [(e.prompt, e.columns) for e in trainer.train_examples[:2]] == [
            ("Q:0+1\nA:", {"answer": "1"}), ("Q:1+1\nA:", {"answer": "2"})]
        assert trainer.eval_examples[1].columns == {"answer": "2"}
        episodes = trainer.rollout(trainer.examples_for_step(0), 0)[0]
        assert trainer.score(episodes).errors == [None] * len(episodes)  # every row scored against its answer
    finally:
        trainer.close()
    both = write_rows(tmp_path / "both.jsonl", [{**r, "answer": "0"} for r in rows])
    with pytest.raises(ConfigError, match=r"both.jsonl line 1: column 'label' is renamed to 'answer', which the row "
                                          r"already has; rename one of them$"):
        GRPOTrainer(tiny_config(model_dir, dataset=both, prompt_column="input", reward_columns=("label:answer",)),
                    log=lambda *_: None)
    for entries, problem in [(("label",), "entry 'label' must be COLUMN:NAME"),
                             (("label:an swer",), "entry 'label:an swer' must be COLUMN:NAME"),
                             (("input:answer",), "entry 'input:answer' renames the prompt column"),
                             (("label:answer", "level:answer"), "entry 'level:answer': each column and each name once")]:
        with pytest.raises(ConfigError, match=f"'reward_columns' {problem}"):
            tiny_config(model_dir, dataset=data, prompt_column="input", reward_columns=entries)
    with pytest.raises(ConfigError, match=r"'reward_columns' \['label:answer'\] renames columns of a dataset file, "
                                          r"and none is given"):
        tiny_config(model_dir, reward_columns=("label:answer",))
