"""Tests of the "math" reward and of `RewardRunner`: in-process and in a worker process, a raising row
costs only its own reward, a hung call times out and the next one runs, and bad return values are
errors that name their rows."""

from __future__ import annotations

import pytest

from tlt.errors import ConfigError
from tlt.rewards import RewardRunner, get_reward, math_reward


def test_math_reward_boxed_latex_and_decimals():
    completions = [
        r"Half of it: $\boxed{\frac{1}{2}}$",
        r"So the answer is \boxed{0.5}.",
        r"\boxed{\frac{2}{4}}",
        r"\boxed{\frac{1}{3}}",
        "I do not know.",
    ]
    assert math_reward([""] * 5, completions, ground_truth=["0.5"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert get_reward("math") is math_reward


def test_math_reward_reads_answer_or_solution_and_chat_completions():
    assert math_reward(["q"], [r"\boxed{(1, 2)}"], answer=["(1, 2)"]) == [1.0]
    assert math_reward(["q"], [r"\boxed{2}"], answer=["(1, 2)"]) == [0.0]
    assert math_reward(["q"], [[{"role": "assistant", "content": r"\boxed{\sqrt{2}}"}]],
                       solution=[r"so it is $\sqrt{2}$"]) == [1.0]


def test_math_reward_without_a_reference_column_names_the_columns_it_needs():
    with pytest.raises(ConfigError, match="'ground_truth', 'answer' or 'solution'.*'target'"):
        math_reward(["q"], ["1"], target=["1"])


ROWS = ["a", "b", "c", "d"]
SOURCES = [f"data.jsonl:{i + 1}" for i in range(4)]


def score(runner, completions):
    return runner.score(ROWS, completions, {"target": ["a", "b", "c", "d"]}, SOURCES)


def test_in_process_runner():
    with RewardRunner("reward_fixtures:by_completion", chunk_size=2) as runner:
        result = score(runner, ["a", "x", "c", "d"])
        assert result.rewards == [1.0, 0.0, 1.0, 1.0] and result.errors == [None] * 4 and result.seconds > 0

        result = score(runner, ["a", "raise", "nan", "d"])
        assert result.rewards == [1.0, 0.0, 0.0, 1.0]
        assert result.errors[0] is None and result.errors[3] is None
        assert result.errors[1].startswith("data.jsonl:2: reward 'reward_fixtures:by_completion' raised ValueError")
        assert result.errors[2].startswith("data.jsonl:3:") and "nan" in result.errors[2]

    with RewardRunner("reward_fixtures:one_too_many") as runner:
        result = score(runner, ROWS)
    assert result.rewards == [0.0] * 4
    assert all(e.startswith(f"{s}:") and "returned 2 values for 1 rows" in e for e, s in zip(result.errors, SOURCES))


def test_a_reward_too_large_for_float32_fails_its_row_naming_the_value():
    """Regression: 1e39 passed the finite check, became inf in the trainer's float32 rewards tensor, and
    the run stopped later with "the loss is nan" without naming the reward."""
    import numpy as np
    import torch

    returned = [3e38, 1e39, -1e300, 10**400, torch.tensor(1e39, dtype=torch.float64), np.float32(2.0)]

    def fixed(prompts, completions, **_):
        return returned

    n = len(returned)
    result = RewardRunner(fixed).score(["p"] * n, ["c"] * n, {}, [f"data.jsonl:{i + 1}" for i in range(n)])
    assert result.rewards == [3e38, 0.0, 0.0, 0.0, 0.0, 2.0]
    assert result.errors[0] is None and result.errors[5] is None
    for i, shown in ((1, "1e+39"), (2, "-1e+300"), (3, "1000000000"), (4, "tensor(1.0000e+39")):
        assert result.errors[i].startswith(f"data.jsonl:{i + 1}: reward 'test_a_reward_too_large_for_float32_")
        assert f"returned {shown}" in result.errors[i] and "too large for the float32" in result.errors[i]
    assert torch.tensor(result.rewards).isfinite().all()


def test_runner_passes_reward_kwargs_and_raises_config_errors():
    runner = RewardRunner("arithmetic", format_weight=0.5)
    assert runner.score(["p", "p"], ["7", "01+6=07;#07"], {"answer": ["08", "08"]}).rewards == [0.0, 0.5]
    with pytest.raises(ConfigError, match="'answer' has 1 entries for 2 prompts"):
        runner.score(["p", "p"], ["#07", "#08"], {"answer": ["08"]})
    with pytest.raises(ConfigError, match="reward 'math'.*'ground_truth'"):
        RewardRunner("math").score(["p"], ["1"], {"target": ["1"]})
    with pytest.raises(ConfigError, match="unknown reward"):
        RewardRunner("no_such_reward", workers=1)
    with pytest.raises(ConfigError, match="cannot be sent to worker processes"):
        RewardRunner(lambda prompts, completions, **_: [0.0] * len(prompts), workers=1)


@pytest.fixture(scope="module")
def pool():
    """One worker process for all the pool tests: spawning one costs about a second."""
    with RewardRunner("reward_fixtures:by_completion", workers=1, timeout_s=1.0, chunk_size=2) as runner:
        yield runner


def test_worker_runner_scores_and_isolates_bad_rows(pool):
    assert score(pool, ["a", "x", "c", "d"]).rewards == [1.0, 0.0, 1.0, 1.0]
    result = score(pool, ["a", "raise", "c", "d"])
    assert result.rewards == [1.0, 0.0, 1.0, 1.0]
    assert result.errors[1].startswith("data.jsonl:2:") and "ValueError: cannot score 'raise'" in result.errors[1]
    assert result.errors.count(None) == 3
    result = score(pool, ["a", "b", "drop", "nan"])
    assert result.rewards == [1.0, 1.0, 0.0, 0.0]
    assert result.errors[2] == "data.jsonl:3: reward 'reward_fixtures:by_completion' returned 0 values for 1 rows"
    assert result.errors[3].startswith("data.jsonl:4:") and "nan" in result.errors[3]


def test_worker_runner_times_out_a_hung_call_and_goes_on(pool):
    result = score(pool, ["a", "hang", "c", "d"])
    assert result.rewards == [0.0, 0.0, 1.0, 1.0]
    for error, source in zip(result.errors[:2], SOURCES):
        assert error.startswith(f"{source}:") and "timed out after 1 s" in error and "data.jsonl:2" in error
    assert result.errors[2:] == [None, None]
    assert result.seconds >= 1.0
    assert score(pool, ROWS).rewards == [1.0] * 4


def test_a_timed_out_call_is_one_failure_naming_its_rows_once(pool):
    """Regression: the trainer logged a timed-out call once per row, each line listing the call's rows."""
    result = score(pool, ["hang", "b", "raise", "d"])
    assert result.failures[0] == ("data.jsonl:1, data.jsonl:2: reward 'reward_fixtures:by_completion' timed out "
                                  "after 1 s; its worker process was restarted")
    assert len(result.failures) == 2 and result.failures[1].startswith("data.jsonl:3: reward")


def test_ctrl_c_reaches_the_trainer_not_the_reward_workers(capfd):
    """Regression: Ctrl-C during a run with reward workers printed two KeyboardInterrupt tracebacks from
    the pool (a terminal sends SIGINT to the whole process group) before the clean "interrupted" line."""
    import os
    import signal
    import time

    with RewardRunner("reward_fixtures:by_completion", workers=2, timeout_s=30.0) as runner:
        for worker in runner._pool:  # while they import
            os.kill(worker.process.pid, signal.SIGINT)
        assert score(runner, ROWS).errors == [None] * 4
        for worker in runner._pool:  # while they wait for a call
            os.kill(worker.process.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(worker.process.is_alive() for worker in runner._pool)
        assert score(runner, ["a", "x", "c", "d"]).rewards == [1.0, 0.0, 1.0, 1.0]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def as_text(prompts, completions, **_):
    return "1.0"


def by_row_index(prompts, completions, **_):
    return {i: 0.5 for i in range(len(completions))}


def as_set(prompts, completions, **_):
    return {1.0}


def calls_sys_exit(prompts, completions, **_):
    raise SystemExit(3)


def test_a_string_mapping_or_set_is_not_a_list_of_rewards():
    """Regression: a returned string was read as one value per character ("returned 3 values"), and a
    mapping by its keys: {0: 0.5, 1: 0.5} for two rows scored them 0.0 and 1.0 without an error."""
    # a failed call is retried row by row, so each message shows what a one-row call returned
    for fn, shown in ((as_text, "str '1.0'"), (by_row_index, "dict {0: 0.5}"), (as_set, "set {1.0}")):
        result = RewardRunner(fn).score(["p", "q"], ["a", "b"], {}, ["d:1", "d:2"])
        assert result.rewards == [0.0, 0.0]
        assert result.errors[0].startswith(f"d:1: reward '{fn.__name__}' returned {shown}"), result.errors
        assert "not a list of" in result.errors[0]


def test_sys_exit_in_a_reward_fails_its_rows_not_the_run():
    """Regression: a reward (or a library it calls) that called sys.exit() ended the training process
    without a message (workers=0), or took its worker process down (workers >= 1)."""
    result = RewardRunner(calls_sys_exit).score(["p"], ["a"], {}, ["d:1"])
    assert result.rewards == [0.0] and result.errors == ["d:1: reward 'calls_sys_exit' raised SystemExit: 3"]


def test_a_reward_module_that_fails_to_import_is_one_error(tmp_path, monkeypatch):
    """Regression: a reward module with a syntax error, or one whose top-level code raised, ended
    `tlt train` in a traceback; a non-callable attribute was "no function"; a file path got no hint."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "typo_reward.py").write_text("def f(prompts, completions, **_):\n    return [1.0 for c in completions\n")
    (tmp_path / "setup_reward.py").write_text("import os\nSCALE = float(os.environ['NO_SUCH_VARIABLE_TLT'])\n")
    (tmp_path / "value_reward.py").write_text("score = 1.0\n")
    with pytest.raises(ConfigError, match=r"^reward 'typo_reward:f': importing module 'typo_reward' raised "
                                          r"SyntaxError: .*typo_reward.py, line 2"):
        get_reward("typo_reward:f")
    with pytest.raises(ConfigError, match="importing module 'setup_reward' raised KeyError: 'NO_SUCH_VARIABLE_TLT'"):
        get_reward("setup_reward:f")
    with pytest.raises(ConfigError, match=r"value_reward.score is not callable \(type float\)"):
        get_reward("value_reward:score")
    with pytest.raises(ConfigError, match="give the module's import name .* not a file path"):
        get_reward(f"{tmp_path / 'value_reward.py'}:score")
