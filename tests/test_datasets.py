"""Tests of `load_examples`: verl-layout Parquet and TRL-layout JSONL load without conversion, columns
reach the reward, and every bad input names the file, the row and the column."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt.data import Example, load_examples
from tlt.errors import ConfigError
from tlt.rewards import RewardRunner


def verl_rows() -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(3)
    ]


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_verl_parquet_loads_nested_columns_as_they_are(tmp_path):
    path = tmp_path / "train.parquet"
    table = pa.Table.from_pylist(verl_rows())
    assert pa.types.is_struct(table.schema.field("reward_model").type)
    assert pa.types.is_list(table.schema.field("prompt").type)
    pq.write_table(table, path)

    examples = load_examples(path)

    assert len(examples) == 3
    first = examples[1]
    assert first.prompt == verl_rows()[1]["prompt"]
    assert first.columns["ground_truth"] == "2"
    assert first.columns["data_source"] == "openai/gsm8k"
    assert first.columns["extra_info"] == {"split": "train", "index": 1}
    assert first.columns["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert "prompt" not in first.columns
    assert [e.source for e in examples] == [f"{path}:{i}" for i in range(3)]


def test_trl_jsonl_extra_columns_reach_the_reward(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [{"prompt": "Say hi.", "target": "hi", "meta": {"k": [1, 2]}}, "",
                       {"prompt": [{"role": "user", "content": "Say yo."}], "target": "yo", "meta": None}])

    examples = load_examples(path)

    assert examples[0] == Example("Say hi.", {"target": "hi", "meta": {"k": [1, 2]}}, f"{path}:1")
    assert examples[1].source == f"{path}:3"  # line numbers count the blank line
    columns = {k: [e.columns[k] for e in examples] for k in examples[0].columns}
    with RewardRunner("reward_fixtures:by_completion") as runner:
        result = runner.score([e.prompt for e in examples], ["hi", "nope"], columns, [e.source for e in examples])
    assert result.rewards == [1.0, 0.0] and result.errors == [None, None]


def test_columns_mapping_and_prompt_column_and_limit(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [{"question": f"q{i}", "answer": str(i), "other": i} for i in range(5)])

    examples = load_examples(path, prompt_column="question", columns={"answer": "ground_truth"}, limit=2)

    assert [e.prompt for e in examples] == ["q0", "q1"]
    assert examples[1].columns == {"ground_truth": "1", "other": 1}


def test_verl_ground_truth_can_be_renamed_and_format_forced(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, verl_rows())
    assert load_examples(path, format="verl", columns={"ground_truth": "solution"})[0].columns["solution"] == "0"
    # read as TRL's layout, the reward_model record passes through unopened
    assert "ground_truth" not in load_examples(path, format="trl")[0].columns


def error_text(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_examples(**kwargs)
    return str(info.value)


def test_file_level_errors_name_the_file(tmp_path):
    assert "no such file" in error_text(path=tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("prompt\nhi\n")
    text = error_text(path=tmp_path / "data.csv")
    assert "data.csv" in text and ".jsonl or .parquet" in text
    (tmp_path / "empty.jsonl").write_text("\n\n")
    text = error_text(path=tmp_path / "empty.jsonl")
    assert "empty.jsonl" in text and "no examples" in text
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert "junk.parquet" in error_text(path=tmp_path / "junk.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "q"}]), tmp_path / "q.parquet")
    text = error_text(path=tmp_path / "q.parquet")
    assert "q.parquet" in text and "'prompt'" in text and "question" in text
    assert "expected one of" in error_text(path=tmp_path / "q.parquet", format="csv")


@pytest.mark.parametrize("row, expected", [
    ('{"prompt": "a"', ["line 2", "not valid JSON"]),
    ('["prompt"]', ["line 2", "JSON object"]),
    ({"question": "a"}, ["line 2", "'prompt'", "question"]),
    ({"prompt": 7}, ["line 2", "column 'prompt'", "prompt string or a list of chat messages"]),
    ({"prompt": "  "}, ["line 2", "column 'prompt'", "empty"]),
    ({"prompt": [{"role": "user"}]}, ["line 2", "column 'prompt'", "message 0", "'content'"]),
])
def test_bad_rows_name_file_line_and_column(tmp_path, row, expected):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [{"prompt": "fine"}, row])
    text = error_text(path=path)
    assert str(path) in text
    for part in expected:
        assert part in text, (part, text)


def test_verl_row_without_ground_truth_and_missing_mapped_column(tmp_path):
    path = tmp_path / "train.parquet"
    rows = verl_rows()
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    pq.write_table(pa.Table.from_pylist(rows), path)
    text = error_text(path=path)
    assert f"{path} row 2" in text and "'reward_model'" in text and "ground_truth" in text
    text = error_text(path=path, columns={"answer": "ground_truth"})
    assert f"{path} row 0" in text and "'answer'" in text


def test_skip_mode_warns_once_naming_the_bad_rows(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [{"prompt": "a"}, "{oops", {"prompt": None}, {"prompt": "b"}])
    with pytest.warns(UserWarning) as caught:
        examples = load_examples(path, on_bad_row="skip")
    assert [e.prompt for e in examples] == ["a", "b"]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "skipped 2" in message and "line 2" in message and "line 3" in message
    write_jsonl(path, ["{oops"])
    with pytest.warns(UserWarning):
        assert "all 1 rows are malformed" in error_text(path=path, on_bad_row="skip")


def test_a_folder_an_upper_case_extension_and_the_setting_that_named_the_file(tmp_path):
    """Regression: a folder was reported as "no such file", an eval file's errors said "dataset", and
    DATA.JSONL was an unknown extension."""
    (tmp_path / "train.jsonl").mkdir()
    assert "train.jsonl: is a folder; expected a .jsonl or .parquet file" in error_text(path=tmp_path / "train.jsonl")
    text = error_text(path=tmp_path / "held.jsonl", name="eval_dataset")
    assert text == f"eval_dataset {tmp_path / 'held.jsonl'}: no such file"
    write_jsonl(tmp_path / "DATA.JSONL", [{"prompt": "a"}])
    assert [e.prompt for e in load_examples(tmp_path / "DATA.JSONL")] == ["a"]
    write_jsonl(tmp_path / "data.json", [{"prompt": "a"}])
    assert "'.json', expected .jsonl or .parquet (JSON lines" in error_text(path=tmp_path / "data.json")


def test_a_row_of_the_other_layout_is_named(tmp_path):
    """Regression: with TRL's layout picked from the first row, a later verl row loaded without its
    `ground_truth` (the reward got None for it); the other way round it was already an error."""
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [{"prompt": "q", "answer": "1"}, verl_rows()[0]])
    text = error_text(path=path)
    assert f"{path} line 2: a 'reward_model' record (verl's layout), but {path} line 1 has no 'reward_model'" in text
    write_jsonl(path, [verl_rows()[0], {"prompt": "q", "answer": "1"}])
    assert f"{path} line 2, column 'reward_model'" in error_text(path=path)
    write_jsonl(path, [{"prompt": "q", "answer": "1"}, verl_rows()[0]])
    assert load_examples(path, format="trl")[1].columns["reward_model"]["ground_truth"] == "0"  # asked for: as is


def test_a_utf8_byte_order_mark_is_read_past(tmp_path):
    """Regression: a JSONL file saved with a byte-order mark (Windows editors) failed at line 1."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a"}).encode() + b"\n" + b'{"prompt": "b"}\n')
    assert [e.prompt for e in load_examples(path)] == ["a", "b"]


def test_parquet_maps_reach_the_reward_as_dicts_and_a_repeated_key_is_named(tmp_path):
    """Regression: a Parquet map column arrived as a list of (key, value) tuples, not a dict."""
    path = tmp_path / "train.parquet"
    weights = pa.map_(pa.string(), pa.float64())
    table = pa.table({"prompt": ["a", "b", "c"],
                      "weights": pa.array([[("x", 1.0), ("y", 2.0)], [], [("x", 1.0), ("x", 3.0)]], type=weights)})
    pq.write_table(table.slice(0, 2), path)
    assert [e.columns["weights"] for e in load_examples(path)] == [{"x": 1.0, "y": 2.0}, {}]

    pq.write_table(table, path)
    text = error_text(path=path)
    assert f"{path} row 2, column 'weights': a map holds the key 'x' twice" in text
    with pytest.warns(UserWarning, match="skipped 1"):
        assert [e.prompt for e in load_examples(path, on_bad_row="skip")] == ["a", "b"]
