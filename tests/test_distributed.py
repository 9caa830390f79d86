"""Data-parallel updates over trainer processes on a tiny random model: two processes give the weights
one process gives, a run with a helper process checkpoints and resumes, a helper's death is reported
naming its rank, and a bad process count fails at start."""

import json
import os
import signal

import pytest
import torch
import torch.distributed as dist

from tlt.config import from_dict
from tlt.errors import ConfigError, TrainingError
from tlt.rl import GRPOTrainer, TrainConfig
from tlt.rl.run import train

from rl_fixtures import save_tiny_policy, tiny_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("dp-model"))


def config(model_dir, **overrides):
    return tiny_config(model_dir, **overrides)


def _episodes(trainer):
    episodes = trainer.rollout(trainer.examples_for_step(0), 0)[0]
    for i, e in enumerate(episodes):  # every response carries signal, so every rank has work
        e.advantage = (1.0, -0.5, 0.25, -0.75)[i % 4]
    return episodes


def test_two_processes_give_the_weights_of_one(model_dir):
    """Micro-batches are small so each slice splits over both ranks; KL and entropy terms make the
    reference log-probs and every diagnostic travel too; two updates of two slices each. Adam's step is
    lr * sign(g) where |g| >> eps, which turns summation-order noise in near-zero gradient entries into
    lr-sized differences (between two packings in one process too); a tiny grad_clip keeps every entry
    far below eps, where the step is linear in the gradient, so the weights measure the summed gradient."""
    c = dict(loss={"kl_coef": 0.05, "entropy_coef": 0.01, "aggregation": "sequence", "old_logprobs": "recompute"},
             optim={"mini_batches": 2, "micro_batch_tokens": 48, "grad_clip": 1e-9})
    rows, before, after = {}, {}, {}
    for n in (1, 2):
        trainer = GRPOTrainer(config(model_dir, trainer_processes=n, **c), log=lambda *_: None)
        try:
            before[n] = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
            episodes = _episodes(trainer)
            for _ in range(2):
                rows[n] = trainer.update(episodes, *trainer.recomputed_logprobs(episodes))
            after[n] = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
            if n == 2:
                trainer.replicas.check(trainer.policy)  # the helper holds rank 0's weights
        finally:
            trainer.close()
    moved = max(float((after[1][k] - before[1][k]).abs().max()) for k in after[1])
    assert moved > 1e-4  # far above the tolerance below: the comparison is not vacuous
    for name, tensor in after[1].items():
        torch.testing.assert_close(after[2][name], tensor, rtol=1e-5, atol=1e-8, msg=name)
    for key in ("loss", "ratio", "clip_fraction", "kl", "entropy", "grad_norm", "ratio_first_max_dev"):
        assert rows[2][key] == pytest.approx(rows[1][key], rel=1e-5, abs=1e-6), key
    assert rows[2]["responses_in_update"] == rows[1]["responses_in_update"] == 16


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time_") and k != "tokens_per_s"}


def test_run_with_a_helper_process_resumes(model_dir, tmp_path):
    """The helper takes rank 0's restored weights and Adam state on resume: otherwise the resumed
    step's summed gradient would differ from a one-process run's."""
    c = config(model_dir, steps=2, save_every=1)
    single = train(c, tmp_path / "single", log=lambda *_: None).metrics
    dp = config(model_dir, steps=2, save_every=1, trainer_processes=2)
    train(dp, tmp_path / "dp", log=lambda *_: None, stop_after=1)
    resumed = train(dp, tmp_path / "dp", resume=True, log=lambda *_: None).metrics
    assert [r["step"] for r in resumed] == [1, 2]
    for got, want in zip(resumed, single):
        got, want = _comparable(got), _comparable(want)
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
            else:
                assert got[key] == value, key
    assert json.loads((tmp_path / "dp" / "config.json").read_text())["trainer_processes"] == 2


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_dead_helper_is_reported_by_rank(model_dir, monkeypatch, when):
    """Killed between updates, the helper is found dead before the next; killed once woken, it breaks
    the collective rank 0 is in. Either way rank 0 raises naming it instead of waiting."""
    trainer = GRPOTrainer(config(model_dir, trainer_processes=2), log=lambda *_: None)
    try:
        episodes = _episodes(trainer)
        (_, process, _), = trainer.replicas.helpers

        def kill():
            os.kill(process.pid, signal.SIGKILL)
            process.join(10)

        if when == "before":
            kill()
        else:
            ring = trainer.replicas._ring
            monkeypatch.setattr(trainer.replicas, "_ring", lambda command: (ring(command), kill()))
        with pytest.raises(TrainingError, match=f"rank 1 \\(exit code -9\\) exited {when}"):
            trainer.update(episodes, {}, {})
    finally:
        trainer.close()


def test_a_helper_that_cannot_start_is_reported_at_once(model_dir, tmp_path):
    from tlt.model import load_model
    from tlt.rl.distributed import Replicas
    from tlt.rl.update import build_optimizer

    policy = load_model(model_dir)
    c = config(tmp_path / "no-model", trainer_processes=2)  # the helper loads the model from here
    with pytest.raises(TrainingError, match="rank 1 \\(exit code 1\\) exited during start-up"):
        Replicas(c, policy, build_optimizer(policy, c.optim))
    assert not dist.is_initialized()


def test_bad_process_count_fails_at_start(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="'trainer_processes'"):
        TrainConfig(trainer_processes=0)
    with pytest.raises(ConfigError, match="trainer_processes"):
        from_dict(TrainConfig, {"trainer_processes": "two"})
    # A process group of someone else's (e.g. under torchrun) is not taken over.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="already has one"):
            GRPOTrainer(config(model_dir, trainer_processes=2), log=lambda *_: None)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
