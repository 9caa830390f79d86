"""Tests of the built-in arithmetic task, its verifier and the character tokenizer."""

from __future__ import annotations

import random
import re
import statistics

import pytest
import torch

from tlt.tasks import (
    TASKS,
    ArithmeticTask,
    CharTokenizer,
    Problem,
    TaskConfig,
    get_task,
    parse_answer,
    verify,
)

GRAMMAR = re.compile(r"(\d{2}[+-]\d=\d{2};)*#\d{2}")


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return ArithmeticTask()


@pytest.fixture(scope="module")
def problems(task: ArithmeticTask) -> list[Problem]:
    return task.sample(4000, seed=1234)


def recompute(start: int, ops: tuple[tuple[str, int], ...], modulus: int = 100) -> int:
    value = start
    for op, b in ops:
        value = value + b if op == "+" else value - b
    return value % modulus


# --- sampling ---------------------------------------------------------------------------------


def test_sample_is_deterministic_by_seed_and_split(task: ArithmeticTask) -> None:
    assert task.sample(50, seed=7) == task.sample(50, seed=7)
    assert task.sample(50, seed=7, split="eval") == ArithmeticTask().sample(50, seed=7, split="eval")
    assert task.sample(50, seed=7) != task.sample(50, seed=8)
    assert task.sample(50, seed=7, split="train") != task.sample(50, seed=7, split="eval")
    # A prefix of a longer sample is the shorter sample: one stream per (seed, split).
    assert task.sample(80, seed=7)[:50] == task.sample(50, seed=7)


def test_sample_does_not_touch_global_random_state(task: ArithmeticTask) -> None:
    random.seed(0)
    expected = random.random()
    random.seed(0)
    task.sample(20, seed=3)
    assert random.random() == expected


def test_unknown_split_and_bad_n_are_rejected(task: ArithmeticTask) -> None:
    with pytest.raises(ValueError, match="split"):
        task.sample(3, seed=0, split="test")
    with pytest.raises(ValueError, match="n must be"):
        task.sample(-1, seed=0)


def test_problem_format_matches_the_documented_example(task: ArithmeticTask) -> None:
    problem = task.problem(47, [("+", 8), ("-", 3), ("+", 5)])
    assert problem.prompt == "Q:47+8-3+5\nA:"
    assert problem.solution == "47+8=55;55-3=52;52+5=57;#57"
    assert problem.answer == "57"
    assert problem.num_steps == 3
    assert problem.ops == (("+", 8), ("-", 3), ("+", 5))


def test_values_wrap_and_are_zero_padded(task: ArithmeticTask) -> None:
    problem = task.problem(3, [("-", 5), ("+", 4)])
    assert problem.solution == "03-5=98;98+4=02;#02"
    assert problem.answer == "02"


def test_reference_solutions_are_correct(task: ArithmeticTask, problems: list[Problem]) -> None:
    config = task.config
    for p in problems:
        assert 1 <= p.num_steps == len(p.ops) <= config.max_steps
        assert 0 <= p.start < config.modulus
        assert all(op in "+-" and 1 <= b <= config.max_operand for op, b in p.ops)
        assert p.prompt == f"Q:{p.start:02d}" + "".join(f"{op}{b}" for op, b in p.ops) + "\nA:"
        assert p.answer == f"{recompute(p.start, p.ops):02d}"
        assert GRAMMAR.fullmatch(p.solution)
        assert p.solution.count(";") == p.num_steps
        assert task.reward(p.solution, p) == 1.0


def test_solution_lengths_are_heavy_tailed(problems: list[Problem]) -> None:
    lengths = [len(p.solution) for p in problems]
    median = statistics.median(lengths)
    p99 = statistics.quantiles(lengths, n=100)[98]
    median_steps = statistics.median(p.num_steps for p in problems)
    print(f"solution length: median {median}, p99 {p99}, ratio {p99 / median:.1f}")
    print(f"median steps {median_steps}")
    assert 1 <= median_steps <= 3
    assert p99 >= 8 * median


def test_step_count_follows_the_zipf_weights() -> None:
    task = ArithmeticTask(TaskConfig(max_steps=4, zipf_exponent=1.0))
    counts = [0] * 5
    for p in task.sample(6000, seed=5):
        counts[p.num_steps] += 1
    # P(k) = k^-1 / (1 + 1/2 + 1/3 + 1/4) for k = 1..4; 6000 draws give a std of < 40 per count.
    norm = 1 + 1 / 2 + 1 / 3 + 1 / 4
    for k in range(1, 5):
        assert abs(counts[k] - 6000 / k / norm) < 200, counts


# --- noisy solutions ----------------------------------------------------------------------------


def test_error_rate_zero_never_errs_and_positive_rate_does(
    task: ArithmeticTask, problems: list[Problem]
) -> None:
    rng = random.Random(0)
    subset = problems[:500]
    clean = [task.solve(p.start, p.ops, error_rate=0.0, rng=rng) for p in subset]
    assert clean == [p.solution for p in subset]

    noisy = [task.solve(p.start, p.ops, error_rate=0.3, rng=rng) for p in subset]
    wrong = 0
    for p, text in zip(subset, noisy):
        assert GRAMMAR.fullmatch(text), text
        assert task.reward(text, p) == verify(text, p.answer)
        corrupted = text != p.solution
        # The injected drift never cancels: a corrupted solution always has a wrong answer.
        assert (parse_answer(text) != p.answer) == corrupted
        wrong += corrupted
    assert 0.2 * len(subset) < wrong < len(subset)


def test_noisy_steps_continue_from_the_written_value(task: ArithmeticTask) -> None:
    text = task.solve(50, [("+", 1)] * 30, error_rate=0.5, rng=random.Random(3))
    steps = text.split(";")[:-1]
    values = [(int(s[:2]), int(s[-2:])) for s in steps]
    for (_, prev_out), (next_in, _) in zip(values, values[1:]):
        assert next_in == prev_out
    errors = [(a + 1) % 100 != c for a, c in values]
    assert any(errors) and not all(errors)
    assert all(1 <= min((c - a - 1) % 100, (a + 1 - c) % 100) <= 10 for (a, c), e in zip(values, errors) if e)


def test_solve_is_reproducible_with_the_same_rng_seed(task: ArithmeticTask) -> None:
    ops = [("+", 3), ("-", 7)] * 10
    first = task.solve(12, ops, error_rate=0.4, rng=random.Random(9))
    assert first == task.solve(12, ops, error_rate=0.4, rng=random.Random(9))


def test_solve_rejects_bad_input(task: ArithmeticTask) -> None:
    with pytest.raises(ValueError, match="rng"):
        task.solve(1, [("+", 1)], error_rate=0.1)
    with pytest.raises(ValueError, match="error_rate"):
        task.solve(1, [("+", 1)], error_rate=1.5, rng=random.Random(0))
    with pytest.raises(ValueError, match="start"):
        task.solve(100, [("+", 1)])
    with pytest.raises(ValueError, match="op"):
        task.solve(1, [("*", 1)])
    with pytest.raises(ValueError, match="op"):
        task.solve(1, [("+", 0)])


# --- verifier -----------------------------------------------------------------------------------


def test_verify_correct_answers() -> None:
    assert verify("47+8=55;55-3=52;52+5=57;#57", "57") == 1.0
    assert verify("#57", "57") == 1.0
    assert verify("some free-form reasoning #57\n  ", "57") == 1.0
    assert verify("#057", "57") == 1.0  # compared as integers
    assert verify("#7", "07") == 1.0


def test_verify_wrong_answers_with_and_without_format_weight() -> None:
    well_formed_wrong = "47+8=55;55-3=52;52+5=58;#58"
    assert verify(well_formed_wrong, "57") == 0.0
    assert verify(well_formed_wrong, "57", format_weight=0.2) == 0.2
    assert verify(well_formed_wrong + "\n", "57", format_weight=0.2) == 0.2
    assert verify("#58", "57", format_weight=0.2) == 0.2
    # Wrong and outside the grammar: no partial credit.
    assert verify("the answer is #58", "57", format_weight=0.2) == 0.0
    assert verify("47+8=55;#5", "57", format_weight=0.2) == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "57",
        "47+8=55;55-3=52;52+5=57;",
        "#",
        "#57abc",
        "#57;",
        "#5 7",
        "#-57",
        "#٥٧",  # non-ASCII digits are not digits here
        "47+8=55;55-3=52;52+5=57;#57 and then more text",
    ],
)
def test_verify_malformed_completions_score_zero(completion: str) -> None:
    assert parse_answer(completion) is None
    assert verify(completion, "57", format_weight=0.5) == 0.0


def test_parse_answer_takes_the_last_hash() -> None:
    assert parse_answer("#12;#34") == "34"
    assert parse_answer("x#07 \n") == "07"


def test_verify_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="format_weight"):
        verify("#57", "57", format_weight=1.5)
    with pytest.raises(ValueError, match="answer"):
        verify("#57", "")


def test_reward_uses_the_configured_format_weight() -> None:
    task = ArithmeticTask(TaskConfig(format_weight=0.1))
    problem = task.problem(47, [("+", 8)])
    assert task.reward("#55", problem) == 1.0
    assert task.reward("47+8=56;#56", problem) == 0.1
    assert task.reward("garbage", problem) == 0.0


def test_width_follows_the_modulus() -> None:
    task = ArithmeticTask(TaskConfig(modulus=1000, max_operand=5))
    problem = task.problem(998, [("+", 5)])
    assert problem.solution == "998+5=003;#003"
    assert problem.prompt == "Q:998+5\nA:"
    assert verify("998+5=004;#004", problem.answer, format_weight=0.5) == 0.5
    assert verify("98+5=04;#04", problem.answer, format_weight=0.5) == 0.0


# --- config and registry ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
        ({"zipf_exponent": -1.0}, "zipf_exponent"),
        ({"zipf_exponent": float("nan")}, "zipf_exponent"),
        ({"modulus": 2}, "modulus"),
        ({"modulus": True}, "modulus"),
        ({"max_operand": 10}, "max_operand"),
        ({"max_operand": 0}, "max_operand"),
        ({"format_weight": -0.1}, "format_weight"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TaskConfig(**kwargs)


def test_registry_builds_tasks_and_rejects_unknown_names_and_keys() -> None:
    assert TASKS["arithmetic"] is ArithmeticTask
    task = get_task("arithmetic", max_steps=5)
    assert task.config.max_steps == 5
    assert all(p.num_steps <= 5 for p in task.sample(200, seed=0))
    with pytest.raises(ValueError, match="arithmetic"):
        get_task("chess")
    with pytest.raises(ValueError, match="max_step"):
        get_task("arithmetic", max_step=5)


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_ids_are_fixed() -> None:
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.vocab_size == len(tok) == 3 + len("0123456789+-*=;#QA: \n")
    assert tok.convert_tokens_to_ids("0") == 3
    assert tok.convert_tokens_to_ids("\n") == tok.vocab_size - 1
    assert tok.convert_tokens_to_ids("<eos>") == 2
    assert tok.convert_ids_to_tokens(1) == "<bos>"
    assert tok.convert_ids_to_tokens(tok.convert_tokens_to_ids("#")) == "#"


def test_tokenizer_round_trips_problem_text(problems: list[Problem]) -> None:
    tok = CharTokenizer()
    for p in problems[:200]:
        text = p.prompt + p.solution
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_tokenizer_special_tokens_in_decode() -> None:
    tok = CharTokenizer()
    ids = tok.encode("#57") + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids) == "#57"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>#57<eos><pad>"
    assert tok.decode(torch.tensor(ids)) == "#57"
    assert tok.decode(iter(ids)) == "#57"
    assert tok.batch_decode([ids, tok.encode("Q:")]) == ["#57", "Q:"]
    assert tok.batch_decode(torch.tensor([ids, ids])) == ["#57", "#57"]


def test_tokenizer_call_matches_encode() -> None:
    tok = CharTokenizer()
    single = tok("Q:1+2")
    assert single["input_ids"] == tok.encode("Q:1+2")
    assert single["attention_mask"] == [1] * 6
    batch = tok(["Q:", "A:1"], add_special_tokens=False)
    assert batch["input_ids"] == [tok.encode("Q:", False), tok.encode("A:1", False)]
    with pytest.raises(TypeError):
        tok(5)


def test_tokenizer_errors() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"'x' at position 3"):
        tok.encode("Q:1x")
    assert tok.decode([3, tok.vocab_size]) == tok.decode([3])
    assert tok.decode([3, tok.vocab_size], skip_special_tokens=False).endswith(f"<unused:{tok.vocab_size}>")
    with pytest.raises(ValueError, match="out of range"):
        tok.convert_ids_to_tokens(tok.vocab_size)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode([[3, 4]])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.convert_tokens_to_ids("<unk>")
    with pytest.raises(ValueError, match="unique"):
        CharTokenizer("aa")


def test_tokenizer_save_and_load_round_trip(tmp_path) -> None:
    tok = CharTokenizer("01#\n")
    path = tok.save_pretrained(tmp_path / "tok")
    assert path.name == "char_tokenizer.json"
    assert sorted(p.name for p in path.parent.iterdir()) == ["char_tokenizer.json"]  # no temp left
    loaded = CharTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded.characters == "01#\n"
    assert [loaded.convert_ids_to_tokens(i) for i in range(len(loaded))] == [
        tok.convert_ids_to_tokens(i) for i in range(len(tok))
    ]
    assert loaded.encode("10#\n") == tok.encode("10#\n")
    tok.save_pretrained(tmp_path / "tok")  # overwriting an existing file works
    assert CharTokenizer.from_pretrained(str(tmp_path / "tok")).characters == "01#\n"


def test_tokenizer_load_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "char_tokenizer.json"))):
        CharTokenizer.from_pretrained(tmp_path)
    path = tmp_path / "char_tokenizer.json"
    path.write_text('{"vocab": {')
    with pytest.raises(ValueError, match=re.escape(str(path))):
        CharTokenizer.from_pretrained(tmp_path)
    path.write_text('{"format": "tlt.CharTokenizer"}')
    with pytest.raises(ValueError, match=re.escape(str(path))):
        CharTokenizer.from_pretrained(tmp_path)


def test_the_transformers_twin_of_the_character_tokenizer_gives_the_same_ids(task: ArithmeticTask) -> None:
    from tlt.tasks import CharTokenizer

    ours = CharTokenizer()
    theirs = ours.to_transformers()
    texts = [p.prompt for p in task.sample(20, seed=3, split="eval")] + [p.solution for p in task.sample(5, seed=4)]
    for text in texts:
        assert theirs(text)["input_ids"] == ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
        ids = ours.encode(text) + [ours.eos_token_id]
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 0)
    assert theirs.batch_decode([ours.encode(t) for t in texts[:3]], skip_special_tokens=True) == texts[:3]


def test_eval_buckets_sort_by_their_first_step_count_the_open_one_last():
    """Regression: `tlt eval --task bench` (chains past 128 steps) computed its result and then crashed
    on sorting the '129+' bucket."""
    from tlt.evaluate import _bucket, _bucket_start

    keys = {_bucket(n) for n in (200, 70, 3, 1, 40, 129)}
    assert sorted(keys, key=_bucket_start) == ["1-1", "3-4", "33-64", "65-128", "129+"]
