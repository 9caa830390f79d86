"""Resume after a kill at any moment: the run is killed (os._exit, as SIGKILL: no cleanup runs) while a
metrics row is written, inside a checkpoint, between a checkpoint's rename and its pointer, and while
an old checkpoint is removed; `--resume` then continues it with every step present exactly once and
the same values as a run never interrupted. A checkpoint torn afterwards (a disk error, a copy cut
short) is detected whole and resume falls back to the previous one with a warning."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tlt.errors import CheckpointError
from tlt.rl.run import train

from rl_fixtures import save_tiny_policy, tiny_config

TESTS = Path(__file__).resolve().parent
FIELDS = dict(steps=3, save_every=1, eval={"every": 3}, keep_checkpoints=2)

# Runs the tiny config in a child process and kills it at `point` during step 2.
KILLER = """
import os, sys, shutil
import torch
torch.set_num_threads(int(os.environ.get("TLT_TEST_THREADS", "1")))  # as conftest: a run's floats depend on it
sys.path.insert(0, {tests!r})
from rl_fixtures import tiny_config
from tlt.rl import checkpoint, metrics, run

point, model, out = sys.argv[1:4]
fields = {fields!r}
if point == "metrics":  # half of step 2's row reaches the file
    write = metrics.MetricsLog.write
    def torn(self, row):
        if row["step"] == 2:
            with self.path.open("a") as f:
                f.write(metrics.json.dumps(row)[:40])
            os._exit(9)
        write(self, row)
    metrics.MetricsLog.write = torn
if point == "checkpoint":  # inside step 2's checkpoint folder, half of trainer_state.pt written
    write_bytes = checkpoint.atomic_write_bytes
    def torn(path, data):
        if "step_00000002" in str(path) and path.name == "trainer_state.pt":
            path.write_bytes(data[: len(data) // 2])
            os._exit(9)
        write_bytes(path, data)
    checkpoint.atomic_write_bytes = torn
if point == "pointer":  # step 2's folder renamed into place, latest.json not yet updated
    write_json = checkpoint.atomic_write_json
    def stop(path, data):
        if path.name == "latest.json" and data["step"] == 2:
            os._exit(9)
        write_json(path, data)
    checkpoint.atomic_write_json = stop
if point == "cleanup":  # keep_checkpoints=1: killed while step 1's folder is being removed
    fields["keep_checkpoints"] = 1
    def halfway(path, ignore_errors=False):
        (path / "trainer_state.pt").unlink()
        os._exit(9)
    checkpoint.shutil = type("shutil", (), dict(rmtree=staticmethod(halfway)))
run.train(tiny_config(model, **fields), out, log=lambda *_: None)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("resume-model"))


@pytest.fixture(scope="module")
def whole(model_dir, tmp_path_factory):
    """The rows of the run never interrupted."""
    return train(tiny_config(model_dir, **FIELDS), tmp_path_factory.mktemp("whole") / "run", log=lambda *_: None).metrics


def same(row):
    return {k: row.get(k) for k in ("step", "reward", "response_lengths", "loss", "grad_norm", "eval_accuracy")}


@pytest.mark.parametrize("point", ["metrics", "checkpoint", "pointer", "cleanup"])
def test_a_kill_at_any_moment_resumes_with_every_step_once(model_dir, whole, tmp_path, point):
    """Regression (metrics): a half-written last row of metrics.jsonl made --resume crash with a raw
    JSONDecodeError."""
    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILLER.format(tests=str(TESTS), fields=FIELDS), point,
                             str(model_dir), str(run)], capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr[-2000:]
    lines = []
    keep = 1 if point == "cleanup" else 2
    resumed = train(tiny_config(model_dir, **{**FIELDS, "keep_checkpoints": keep}), run, resume=True,
                    log=lines.append).metrics
    assert [same(r) for r in resumed] == [same(r) for r in whole]
    on_disk = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in on_disk] == [0, 1, 2, 3]
    assert not list((run / "checkpoints").glob(".tmp-*"))  # a killed checkpoint's folder is cleared
    if point == "metrics":
        assert any("incomplete last row" in x for x in lines)


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "policy/model.safetensors", "drafting.json"])
def test_a_torn_newest_checkpoint_falls_back_to_the_previous_one(model_dir, tmp_path, damaged):
    """Regression: a torn drafting.json (then tuner.json) gave a traceback, and no torn file let resume use the previous
    complete checkpoint."""
    fields = dict(FIELDS, speculative="adaptive", tuner={"arms": ("off", "ngram-d4")}, eval={"every": 0})
    config = tiny_config(model_dir, **fields)
    whole = train(config, tmp_path / "whole", log=lambda *_: None).metrics
    run = tmp_path / "run"
    train(config, run, log=lambda *_: None, stop_after=2)
    path = run / "checkpoints" / "step_00000002" / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    lines = []
    resumed = train(config, run, resume=True, log=lines.append).metrics
    assert any(f"cannot resume from step_00000002: {path}" in x for x in lines), lines
    assert any("resuming from step_00000001" in x for x in lines)
    # The same samples; old log-probs come from whichever forward the tuner's (timed) choice ran, equal up
    # to float rounding, so the loss is compared to rounding.
    assert [same(r) | {"loss": None, "grad_norm": None} for r in resumed] == [
        same(r) | {"loss": None, "grad_norm": None} for r in whole]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], rel=1e-4)
    for folder in (run / "checkpoints").glob("step_*"):  # now torn beyond repair: say so, name the files
        (folder / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="none of its 2 checkpoints can be read .*trainer_state.pt"):
        train(config, run, resume=True, log=lambda *_: None)
