"""Rollout on a local Ray cluster with 2 workers: same outputs as in-process, restart of a killed worker,
spot training on a released worker, and a GRPO run (with resume) on the pool."""

import json
import os

import pytest
import torch

ray = pytest.importorskip("ray")

from tlt.rl.config import EvalConfig, OptimConfig, TrainConfig  # noqa: E402
from tlt.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from tlt.spot.config import SpotConfig  # noqa: E402
from tlt.spot.rollout import DrafterLearning, PooledRollout  # noqa: E402
from tlt.spot.workers import RayPool, RolloutWorker, WorkerSpec, start_ray  # noqa: E402

from rl_fixtures import save_tiny_policy  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = save_tiny_policy(tmp_path_factory.mktemp("ray-model"))
    start_ray(None, cpus=2)
    yield folder
    ray.shutdown()


PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 4], [1, 8, 3, 3, 3], [1, 6]]


def params(long_first: bool = False):
    return [SamplingParams(n=3, temperature=1.0, max_tokens=240 if (long_first and i == 0) else 24, ignore_eos=True,
                           seed=100 + i) for i in range(len(PROMPTS))]


def pool_of(model_dir, n=2, pool=RayPool, **spec_fields):
    from tlt.model import load_model

    specs = [WorkerSpec(str(model_dir), seed=0, **spec_fields) for _ in range(n)]
    pool = pool(specs, log=lambda *_: None)
    pool.load_weights(load_model(model_dir).state_dict(), 0)
    return pool


def crashing_pool(marker: str, prompt: list[int], after_steps: int) -> type[RayPool]:
    """A pool whose workers exit abruptly, as a crashed or preempted machine would, `after_steps` engine
    steps into generating a share that holds `prompt`, once: the first to crash leaves the file `marker`,
    which keeps its replacement (and every later share) alive. Made inside a function so that Ray ships
    the worker class by value: the workers cannot import the tests."""

    class CrashingWorker(RolloutWorker):
        def generate(self, prompts, *args, **kwargs):
            self.crash = prompt in prompts and not os.path.exists(marker)
            return super().generate(prompts, *args, **kwargs)

        def _between_steps(self, engine) -> None:
            if self.crash and engine.rollout_stats.steps >= after_steps:
                open(marker, "w").close()
                os._exit(17)
            super()._between_steps(engine)

    class CrashingPool(RayPool):
        worker = CrashingWorker

    return CrashingPool


def flat(outputs):
    return [(tuple(o.prompt_token_ids), c.index, tuple(c.token_ids)) for o in outputs
            for c in o.outputs]


def test_pool_returns_what_the_in_process_engine_returns(model_dir):
    from tlt.model import load_model

    engine = RolloutEngine(load_model(model_dir), config=EngineConfig(progress=False))
    expected = engine.generate(PROMPTS, params())
    rollout = PooledRollout(pool_of(model_dir), None, log=lambda *_: None)
    try:
        outputs, report = rollout.generate(PROMPTS, params(), 0, 0)
        assert flat(outputs) == flat(expected)
        for a, b in zip(outputs, expected):
            for x, y in zip(a.outputs, b.outputs):
                assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert sorted(report.pool.shares) == [2, 3]
        assert report.stats.decode_tokens == sum(len(c.token_ids) for o in outputs for c in o.outputs)
    finally:
        rollout.close()


def test_bf16_workers_get_the_policy_in_bf16_and_sample_what_a_bf16_engine_does(model_dir):
    """The driver casts the float32 policy to the workers' dtype before it enters the object store (half
    the bytes); the cast is the one a worker's own copy made, so the samples are the in-process ones."""
    from tlt.model import load_model

    policy = load_model(model_dir).state_dict()
    engine = RolloutEngine(load_model(model_dir, dtype="bfloat16"), config=EngineConfig(progress=False))
    engine.load_weights(policy, 0)
    expected = engine.generate(PROMPTS, params())
    pool = pool_of(model_dir, dtype="bfloat16")
    rollout = PooledRollout(pool, None, log=lambda *_: None)
    try:
        assert all(v.dtype == torch.bfloat16 for v in ray.get(pool.policy[0]).values())
        outputs, _ = rollout.generate(PROMPTS, params(), 0, 0)
        assert flat(outputs) == flat(expected)
    finally:
        rollout.close()


def test_a_worker_killed_mid_rollout_is_restarted_without_losing_or_duplicating_samples(model_dir, tmp_path):
    clean = PooledRollout(pool_of(model_dir), None, log=lambda *_: None)
    try:
        expected, _ = clean.generate(PROMPTS, params(), 0, 0)
    finally:
        clean.close()
    lines = []
    pool = crashing_pool(str(tmp_path / "crashed"), PROMPTS[0], after_steps=3)  # worker 0's share holds PROMPTS[0]
    rollout = PooledRollout(pool_of(model_dir, pool=pool), None, log=lines.append)
    try:
        outputs, report = rollout.generate(PROMPTS, params(), 0, 0)
        assert flat(outputs) == flat(expected)  # each sample once, exactly as without the crash
        assert len(flat(outputs)) == len(set(flat(outputs))) == 3 * len(PROMPTS)
        assert report.pool.times.restarts == [1, 0] and rollout.pool.restarts == 1
        assert any("worker 0 died" in line for line in lines)
        again, _ = rollout.generate(PROMPTS, params(), 0, 1)  # the replacement keeps working
        assert flat(again) == flat(expected)
    finally:
        rollout.close()


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle1", "eagle3"])
def test_released_worker_trains_the_drafter_and_every_worker_gets_it(model_dir, tmp_path, eagle3):
    """With an EAGLE-3 drafter (fused target layers) the workers' rollouts carry those layers' states
    into the buffer, and the trained fusion reaches every worker too."""
    from tlt.model import load_model
    from tlt.speculative.drafter import Drafter, DrafterConfig

    config = SpotConfig(train="every", min_pairs=1, lr=3e-3, batch_tokens=128, rows=2, window=32)
    target = load_model(model_dir)
    drafter, layers = "random", None
    if eagle3:
        layers = (0, target.config.num_hidden_layers - 1)
        Drafter.from_target(target, feature_layers=layers, seed=0).save(tmp_path / "eagle3")
        drafter = str(tmp_path / "eagle3")
    learning = DrafterLearning(config, DrafterConfig.for_target(target, layers), None, log=lambda *_: None)
    pool = pool_of(model_dir, engine=EngineConfig(speculative="adaptive", drafter=drafter))
    rollout = PooledRollout(pool, learning, log=lambda *_: None, swap_every=1)
    try:
        _, first = rollout.generate(PROMPTS, params(long_first=True), 0, 0)
        assert rollout.finish_step(0) is None  # the buffer was empty when the first rollout started
        assert learning.buffer.pairs > 0
        _, second = rollout.generate(PROMPTS, params(long_first=True), 0, 1)
        assert second.pool.training_due
        report = rollout.finish_step(1)
        trainer = report.worker
        assert second.pool.times.training_s[trainer] > 0
        assert report.steps >= 1 and learning.version == 1, report
        # the tail worker took the trainer's drafter mid-rollout (hot swap)
        assert report.offers >= 1 and second.pool.drafter_swaps >= 1, (report, second.pool)
        assert report.stop_latency_s is not None and report.stop_latency_s < 5.0
        _, third = rollout.generate(PROMPTS, params(long_first=True), 0, 2)
        assert third.pool.drafter_version == 1
        rollout.finish_step(2)  # pushes the newest drafter to every worker
        states = ray.get([a.drafting_state.remote() for a in pool.actors])
        assert all(s is not None and s["tuner"] is not None for s in states)
        trained = learning.state["drafter"]
        assert ("fuse.weight" in trained) == eagle3
        if eagle3:
            assert all(e.record.layers is not None for e in learning.buffer.entries)
        for actor in pool.actors:  # every worker drafts with the trained weights
            for name in ("fc.weight", "fuse.weight") if eagle3 else ("fc.weight",):
                assert torch.equal(ray.get(actor.drafter_tensor.remote(name)), trained[name])
    finally:
        rollout.close()


def test_grpo_on_two_ray_workers_runs_and_resumes(model_dir, tmp_path):
    from tlt.rl.run import train

    config = TrainConfig(model=str(model_dir), speculative="adaptive", workers=2,
                         reward="reward_fixtures:digit_fraction", train_problems=32, prompts_per_step=4, group_size=4,
                         max_response_tokens=16, eval=EvalConfig(every=0), save_every=1, steps=2, optim=OptimConfig(lr=1e-2),
                         drafter=SpotConfig(model="random", train="every", min_pairs=1, batch_tokens=128, window=32))
    run = tmp_path / "run"
    train(config, run, log=lambda *_: None, stop_after=1)
    trainer = train(config, run, resume=True, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(len(r["workers"]["shares"]) == 2 for r in rows)
    assert trainer.step == 2
    drafting = json.loads((run / "checkpoints" / "step_00000002" / "drafting.json").read_text())
    assert len(drafting["workers"]) == 2 and all(w["tuner"] and w["calibration"] == {"table": [], "by_match": []} for w in drafting["workers"])  # no suffix arm: nothing learned


def test_a_killed_run_leaves_no_ray_process_behind():
    """Regression: after kill -9 of a run on the local cluster, Ray's dashboard agent and runtime-env agent
    stayed alive for about a minute (about 180 MB), and the cluster's start printed nothing for ~10 s."""
    import subprocess
    import sys
    import time

    script = ("import os, time\nfrom tlt.spot.cluster import descendants, start_ray\nstart_ray(None, cpus=1)\n"
              "print('CLUSTER', *descendants(os.getpid()), flush=True)\ntime.sleep(600)\n")
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert run.stdout.readline().startswith("starting a local Ray cluster (1 CPUs")
    line = next(x for x in run.stdout if x.startswith("CLUSTER"))
    pids = [int(p) for p in line.split()[1:]]

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no memory
        except OSError:
            return False

    def title(pid):
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()

    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= {title(p).strip("\0") for p in pids}
    run.kill()
    run.wait()
    deadline = time.monotonic() + 20
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [title(p) for p in pids if alive(p)]
