"""The history store: per-prompt responses, bounded in bytes with the oldest evicted first, saved and restored."""

import pytest

from tlt.errors import ConfigError
from tlt.speculative.history import ENTRY_BYTES, HistoryConfig, HistoryStore, prompt_key


def response_bytes(n):
    return ENTRY_BYTES + 4 * n


def megabytes(n_bytes):
    """`n_bytes` in the unit of HistoryConfig.mb (exact: a power-of-two divisor)."""
    return n_bytes / (1 << 20)


def test_keeps_the_last_responses_per_prompt_oldest_first():
    store = HistoryStore(HistoryConfig(responses=3))
    store.add([1, 2], [[10], [11]], version=0)
    store.add([1, 2], [[12], [13]], version=1)
    store.add([3], [[20]], version=1)
    assert store.responses([1, 2]) == [[11], [12], [13]]
    assert store.responses([3]) == [[20]] and store.responses([4]) == []
    assert store.nbytes == 4 * response_bytes(1)


def test_evicts_the_oldest_responses_of_the_whole_store_by_bytes():
    store = HistoryStore(HistoryConfig(responses=10, mb=megabytes(3 * response_bytes(5))))
    store.add([1], [[1] * 5, [2] * 5], version=0)
    store.add([2], [[3] * 5], version=1)
    assert store.nbytes == 3 * response_bytes(5)
    store.add([2], [[4] * 5], version=2)  # over the bound: prompt [1]'s oldest response goes
    assert store.responses([1]) == [[2] * 5] and store.responses([2]) == [[3] * 5, [4] * 5]
    store.add([3], [[5] * 10], version=3)  # a longer one evicts two
    assert store.responses([1]) == [] and store.responses([2]) == [[4] * 5]
    assert store.nbytes == response_bytes(5) + response_bytes(10) <= store.config.max_bytes
    assert store.stats()["history_prompts"] == 2  # an emptied prompt is forgotten


def test_max_age_and_hit_rate():
    store = HistoryStore(HistoryConfig(max_age=2))
    store.add([1], [[7]], version=0)
    store.add([1], [[8]], version=3)
    assert store.responses([1], version=4) == [[8]] and store.responses([1]) == [[7], [8]]
    drafts = store.drafts([[1], [9]], version=4)
    assert drafts.responses == [[[8]], []]
    assert store.stats()["history_hit_rate"] == 0.5
    assert drafts.select([1]).responses == [[]]


def test_window_holds_the_most_recent_responses_of_any_prompt():
    store = HistoryStore(HistoryConfig(window=3))
    store.add([1], [[1], [2]], 0)
    store.add([2], [[3], [4]], 0)
    assert store.drafts([[5]]).window == [[2], [3], [4]]
    capped = HistoryStore(HistoryConfig(window=3, window_tokens=5))  # the newest responses that fit in 5 tokens
    capped.add([1], [[1, 1], [2, 2, 2]], 0)
    capped.add([2], [[3, 3]], 0)
    assert capped.drafts([[5]]).window == [[2, 2, 2], [3, 3]]
    with pytest.raises(ConfigError, match="window_tokens"):
        HistoryConfig(window_tokens=-1)


def test_state_round_trip_continues_identically():
    config = HistoryConfig(responses=2, mb=megabytes(6 * response_bytes(3)))
    store = HistoryStore(config)
    for step in range(5):
        store.add([step % 3], [[step, step + 1, step + 2], [9, step, 9]], version=step)
    restored = HistoryStore(config)
    restored.load_state_dict(store.state_dict())
    for s in (store, restored):
        s.add([0], [[42] * 3], version=5)
    assert restored.state_dict() == store.state_dict()
    assert [restored.responses([p]) for p in range(3)] == [store.responses([p]) for p in range(3)]


def test_restoring_into_smaller_bounds_keeps_the_newest():
    store = HistoryStore(HistoryConfig(responses=4))
    store.add([1], [[1], [2], [3], [4]], 0)
    small = HistoryStore(HistoryConfig(responses=2, mb=megabytes(10 * response_bytes(1))))
    small.load_state_dict(store.state_dict())
    assert small.responses([1]) == [[3], [4]]


def test_prompt_key_is_stable_and_config_checked():
    assert prompt_key([1, 2, 3]) == prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])
    assert prompt_key([1, 2, 3]) == "e2e2033ae7e19d680599d4eb0a1359a2"  # the same in every process and run
    with pytest.raises(ConfigError, match="field 'responses' must be an integer >= 0"):
        HistoryConfig(responses=-1)
    with pytest.raises(ConfigError, match="field 'mb' must be a finite number"):
        HistoryConfig(mb=True)


def test_a_run_drafts_from_earlier_epochs_and_resumes_with_the_same_history(tmp_path):
    """Prompts come back every 2 steps (8 problems, 4 per step): from step 3 the suffix drafter drafts from
    the responses of their first epoch. A run killed after step 3 and resumed must draft step 4 from the
    very history of the uninterrupted run (it is in the checkpoint), so the rows agree, history credit too."""
    from rl_fixtures import save_tiny_policy, tiny_config
    from tlt.rl.checkpoint import latest_checkpoint, load_state
    from tlt.rl.run import train

    model = save_tiny_policy(tmp_path / "model")
    c = tiny_config(model, speculative="on", strategy="suffix-d8-v16", train_problems=8, steps=4, save_every=1,
                    max_response_tokens=24)

    def comparable(row):
        return {k: v for k, v in row.items() if not k.startswith("time_") and k not in ("tokens_per_s",)}

    whole = train(c, tmp_path / "whole", log=lambda *_: None).metrics
    assert [r["history_hit_rate"] for r in whole] == [0.0, 0.0, 1.0, 1.0]
    assert whole[-1]["draft_sources"]["history"][2] > 0  # accepted drafts from the first epoch
    assert whole[-1]["history_responses"] == 64 and whole[-1]["history_bytes"] > 0
    assert 0 < whole[-1]["drafted_by_strategy"]["suffix-d8-v16"] <= 16  # draft tokens verified a row-step
    train(c, tmp_path / "killed", log=lambda *_: None, stop_after=3)
    saved = load_state(latest_checkpoint(tmp_path / "killed")).history
    assert len(saved["entries"]) == 48  # 3 steps x 4 prompts x 4 samples
    resumed = train(c, tmp_path / "killed", resume=True, log=lambda *_: None).metrics
    assert comparable(resumed[-1]) == comparable(whole[-1])


def test_history_is_kept_only_when_an_arm_drafts_from_it(tmp_path):
    from rl_fixtures import tiny_config

    assert not tiny_config(tmp_path, speculative="on", strategy="ngram-d4").drafts_from_history()
    assert tiny_config(tmp_path, speculative="adaptive", tuner={"arms": ("off", "suffix-d16-v32")}).drafts_from_history()
    assert not tiny_config(tmp_path, speculative="adaptive", tuner={"arms": ("off", "suffix-d16-v32")},
                           history={"responses": 0}).drafts_from_history()
    with pytest.raises(ConfigError, match="field 'history.mb' must be > 0"):
        tiny_config(tmp_path, speculative="on", strategy="suffix-d16-v32", history={"mb": 0})
