"""`tlt report` on real (tiny) GRPO runs, and the metrics log's TensorBoard and W&B (offline) outputs."""

import json
import struct
import sys

import pytest

from tlt.cli import main
from tlt.errors import ConfigError
from tlt.report import write_report
from tlt.rl import TrainConfig
from tlt.rl.config import EvalConfig, LogConfig, OptimConfig
from tlt.rl.metrics import MetricsLog
from tlt.rl.run import train
from tlt.spot import SpotConfig

FIGURES = ("learning.png", "lengths.png", "step_time.png", "acceptance.png", "strategies.png")


def wandb_offline(monkeypatch, root):
    """W&B writes only under `root`: no login, no network, nothing in the home directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(root / name.lower()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 2-step runs of one tiny model with eval every step: speculation on (ngram-d4) and off; the
    off run also logs to TensorBoard and to W&B offline through its TrainConfig."""
    from rl_fixtures import save_tiny_policy

    root = tmp_path_factory.mktemp("report")
    save_tiny_policy(root / "model")
    common = dict(model=str(root / "model"), workers=1, reward="reward_fixtures:digit_fraction", train_problems=32,
                  prompts_per_step=4, group_size=4, max_response_tokens=16,
                  eval=EvalConfig(every=1, problems=4, samples=2), save_every=0, steps=2, drafter=SpotConfig(model=None),
                  optim=OptimConfig(lr=1e-2))
    train(TrainConfig(speculative="on", strategy="ngram-d4", **common), root / "on", log=lambda *_: None)
    with pytest.MonkeyPatch.context() as mp:
        wandb_offline(mp, root)
        train(TrainConfig(speculative="off", log=LogConfig(tensorboard=True, wandb=True), **common), root / "off",
              log=lambda *_: None)
    return root


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    assert data[-8:-4] == b"IEND", f"{path} is truncated"
    return struct.unpack(">II", data[16:24])


def test_report_draws_every_figure_and_links_them(runs, capsys):
    assert main(["report", str(runs / "on")]) == 0
    out = runs / "on" / "report"
    text = (out / "report.md").read_text()
    for name in FIGURES:
        width, height = png_size(out / name)
        assert 600 <= width <= 1600 and 350 <= height <= 900, (name, width, height)
        assert (out / name).stat().st_size > 10_000
        assert f"]({name})" in text
    assert "ngram-d4" in text and "Mean acceptance length" in text
    table = text[text.index("Decode tokens a second by live rows"):].split("\n\n")[1].splitlines()
    assert table[0].startswith("| live rows | ngram-d4")
    bins = [line.split("|")[1].strip() for line in table[2:]]  # powers of two: "1", "2-3", "4-7", ...
    assert bins and all(b == "1" or int(b.split("-")[1]) == 2 * int(b.split("-")[0]) - 1 for b in bins)
    rates = [float(cell) for line in table[2:] for cell in line.strip("|").split("|")[1:] if cell.strip() != "-"]
    assert rates and all(r > 0 for r in rates)
    assert "| eval_accuracy |" in text and "| rollout |" in text and "Over all 32 responses" in text
    assert "wrote" in capsys.readouterr().out


def test_a_run_without_speculation_skips_the_acceptance_figure(runs, tmp_path):
    assert main(["report", str(runs / "off"), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert not (tmp_path / "r" / "acceptance.png").exists() and not (tmp_path / "r" / "strategies.png").exists()
    assert "did not speculate (speculative=off)" in text and "acceptance.png" not in text
    for name in ("learning.png", "lengths.png", "step_time.png"):
        png_size(tmp_path / "r" / name)


def test_compare_draws_both_runs_on_one_plot(runs, tmp_path):
    assert main(["report", str(runs / "on"), "--compare", str(runs / "off"), "--labels", "spec-on", "spec-off",
                 "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    for name in ("compare_learning.png", "compare_step_time.png"):
        png_size(tmp_path / name)
        assert f"]({name})" in text
    assert "## Comparison" in text and "| | spec-on | spec-off |" in text and "Mean step time spec-on / spec-off" in text


def test_missing_metrics_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--labels", "a", "b"]) == 2
    assert "--compare" in capsys.readouterr().err


def test_a_torn_last_line_of_a_live_run_is_left_out(runs, tmp_path):
    (tmp_path / "live").mkdir()
    good = (runs / "on" / "metrics.jsonl").read_text()
    (tmp_path / "live" / "metrics.jsonl").write_text(good + '{"step": 3, "rew')
    text = write_report(tmp_path / "live").read_text()
    assert "Steps done: 2." in text and "(config.json missing)" in text
    (tmp_path / "live" / "metrics.jsonl").write_text('{"step": 3, "rew\n' + good)
    with pytest.raises(ConfigError, match="line 1: not valid JSON"):
        write_report(tmp_path / "live")


def test_tensorboard_and_wandb_offline_receive_the_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = runs / "off"
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2]
    assert [e.step for e in events.Scalars("eval_accuracy")] == [0, 1, 2]
    assert "response_lengths" not in events.Tags()["scalars"]  # lists stay in the JSONL
    run_id = json.loads((run_dir / "wandb_run.json").read_text())["id"]
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    wandb_offline(monkeypatch, tmp_path)
    first = MetricsLog(tmp_path, wandb_project="tlt", run_config={"steps": 2})
    first.write({"step": 1, "reward": 0.5})
    first.close()
    again = MetricsLog(tmp_path, keep_until=1, wandb_project="tlt")
    again.write({"step": 2, "reward": 0.7})
    again.close()
    run_id = json.loads((tmp_path / "wandb_run.json").read_text())["id"]
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
    assert [r["step"] for r in again.rows] == [1, 2]


def test_wandb_missing_names_the_package_and_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ImportError, match="log.wandb=true needs the wandb package"):
        MetricsLog(tmp_path, wandb_project="tlt")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_run_on_a_user_dataset_names_the_dataset_not_the_builtin_task(runs, tmp_path, capsys):
    """report.md showed `task | arithmetic` (the unused default) for a run on a user dataset."""
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "metrics.jsonl").write_text((runs / "on" / "metrics.jsonl").read_text() + '{"step": 3, "rew')
    config = {**json.loads((runs / "on" / "config.json").read_text()), "dataset": "data/train.jsonl"}
    (tmp_path / "user" / "config.json").write_text(json.dumps(config))
    text = write_report(tmp_path / "user").read_text()
    assert "| dataset | data/train.jsonl |" in text and "| task |" not in text
    assert "| task | arithmetic |" in write_report(runs / "on").read_text()
    assert "metrics.jsonl line 4: incomplete last row" in capsys.readouterr().err


def test_a_flat_config_of_the_previous_release_shows_the_same_highlights(runs, tmp_path):
    """config.json of a run written before groups holds flat keys (lr, drafter): the report reads them
    under their dotted names."""
    from pathlib import Path

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text((runs / "on" / "metrics.jsonl").read_text())
    flat = json.loads((Path(__file__).parent / "flat_run_config.json").read_text())
    (tmp_path / "old" / "config.json").write_text(json.dumps({**flat, "lr": 0.01, "drafter": "default"}))
    text = write_report(tmp_path / "old").read_text()
    assert "| optim.lr | 0.01 |" in text and "| drafter.model | default |" in text
    assert "| optim.lr | 0.01 |" in write_report(runs / "on").read_text()  # the nested layout of this release
