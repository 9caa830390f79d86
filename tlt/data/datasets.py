"""Users' RL datasets, JSONL or Parquet, read into `Example` records without a conversion step.

Two layouts are read as they are found in the wild:

- verl's: `prompt` is a list of chat messages, `reward_model` a record holding `ground_truth` (and
  perhaps `style`), plus `data_source` and often `extra_info`. The reference answer becomes the column
  `ground_truth`; every other top-level column (`reward_model` itself included) passes through, nested
  records and Parquet maps as dicts, so a reward can read `extra_info["split"]` or
  `reward_model["style"]`.
- TRL's: a `prompt` column (text or chat messages); every other column passes to the reward as is.

`format="auto"` picks verl's layout when the first row has a `reward_model` column; a later row of
the other layout is a bad row (read as TRL's, a verl row would reach the reward without its
`ground_truth`). `columns` renames
dataset columns to the keyword names a reward expects (`{"answer": "ground_truth"}`), after the layout
is read, so `ground_truth` can itself be renamed. Each example's `source` is `file:N`: the 1-based
line for JSONL (what an editor shows), the 0-based row index for Parquet (what pandas and pyarrow
show).

Bad input. Problems with the file as a whole (missing file, a folder, unknown extension, unreadable
Parquet, no prompt column in a Parquet schema, no examples at all) always raise `ConfigError`, naming
the setting that gave the path (`name`). A malformed row (bad JSON, not an object, missing prompt, a
prompt that is neither text nor messages, a verl row with no ground truth, a row of the other layout,
a renamed column it lacks, a Parquet map with a repeated key) raises `ConfigError` naming the file,
line or row and the column with `on_bad_row="error"`, the default, because a silently shrunk dataset
skews a run; with `on_bad_row="skip"` such rows are left out and one warning names how many and the
first few. A UTF-8 byte-order mark at the start of a JSONL file (Windows editors write one) is read
past.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Iterator

from tlt.data.example import Example
from tlt.errors import ConfigError

FORMATS = ("auto", "verl", "trl")
_SHOWN_SKIPS = 5  # bad rows quoted in the skip warning; the rest are counted


class _BadRow(Exception):
    """A row that cannot become an example; the message names the row and the column."""


def load_examples(path: str | Path, format: str = "auto", prompt_column: str = "prompt",
                  columns: dict[str, str] | None = None, limit: int | None = None,
                  on_bad_row: str = "error", name: str = "dataset") -> list[Example]:
    """The examples of a `.jsonl` or `.parquet` file: at most `limit`, in file order.

    `format` is "auto", "verl" or "trl"; `prompt_column` names the prompt column; `columns` maps
    dataset column names to reward keyword names; `on_bad_row` is "error" or "skip"; `name` is the
    setting that gave `path` (`eval_dataset`, `--dataset`), which errors about the whole file name.
    """
    if format not in FORMATS:
        raise ConfigError(f"dataset format {format!r}: expected one of {list(FORMATS)}")
    if on_bad_row not in ("error", "skip"):
        raise ConfigError(f"on_bad_row {on_bad_row!r}: expected 'error' or 'skip'")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"dataset limit {limit!r}: expected a positive integer or None")
    renames = dict(columns or {})
    if len(set(renames.values())) != len(renames):
        raise ConfigError(f"dataset columns mapping {renames}: two dataset columns map to the same name")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{name} {path}: is a folder; expected a .jsonl or .parquet file")
    if not path.is_file():
        raise ConfigError(f"{name} {path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, prompt_column, name)
    else:
        hint = " (JSON lines, one object per line, are read from a .jsonl file)" if suffix == ".json" else ""
        raise ConfigError(f"{name} {path}: unknown extension {path.suffix!r}, expected .jsonl or .parquet{hint}")

    layout = None if format == "auto" else format
    first = None  # the source of the row the layout was picked from (format="auto")
    examples: list[Example] = []
    skipped: list[str] = []
    for source, row in rows:
        try:
            if isinstance(row, _BadRow):  # a line the reader could not parse: handled like any bad row
                raise row
            if layout is None:
                layout, first = ("verl" if "reward_model" in row else "trl"), source
            if first is not None and layout == "trl" and isinstance(row.get("reward_model"), dict):
                raise _BadRow(f"{_where(source)}: a 'reward_model' record (verl's layout), but {_where(first)} has "
                              "no 'reward_model' column (TRL's layout, picked from the first row); give every row "
                              "the same layout")
            examples.append(_example(row, source, layout, prompt_column, renames))
        except _BadRow as bad:
            if on_bad_row == "error":
                raise ConfigError(str(bad)) from None
            skipped.append(str(bad))
        if limit is not None and len(examples) == limit:
            break
    if skipped:
        shown = "; ".join(skipped[:_SHOWN_SKIPS]) + ("; ..." if len(skipped) > _SHOWN_SKIPS else "")
        warnings.warn(f"{name} {path}: skipped {len(skipped)} malformed rows: {shown}", stacklevel=2)
    if not examples:
        why = f"all {len(skipped)} rows are malformed" if skipped else "the file has no rows"
        raise ConfigError(f"{name} {path}: no examples ({why})")
    return examples


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict | _BadRow]]:
    """(source, row) per non-blank line; a line that is not a JSON object comes as a `_BadRow`.
    Lines are decoded one by one so a stray byte costs one row, not the file."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            source = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield source, _BadRow(f"{path} line {number}: not UTF-8 text ({exc})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield source, _BadRow(f"{path} line {number}: not valid JSON ({exc})")
                continue
            if not isinstance(row, dict):
                yield source, _BadRow(f"{path} line {number}: expected a JSON object, got {type(row).__name__}")
                continue
            yield source, row


def _parquet_rows(path: Path, prompt_column: str, name: str) -> Iterator[tuple[str, dict | _BadRow]]:
    """(source, row) per Parquet row, read batch by batch so `limit` does not read the whole file;
    nested structs and maps arrive as dicts, lists as lists. A row with a map no dict can hold (a
    repeated key, record keys) comes as a `_BadRow`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{name} {path}: not a readable Parquet file ({exc})") from exc
    names = file.schema_arrow.names
    if prompt_column not in names:
        raise ConfigError(f"{name} {path}: no column {prompt_column!r} for the prompt; columns are {names}")
    index = 0
    batches = file.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise ConfigError(f"{name} {path}: cannot read its rows from row {index} on ({exc})") from exc
        if batch is None:
            return
        try:
            rows = batch.to_pylist(maps_as_pydicts="strict")
        except (KeyError, TypeError):
            rows = [_parquet_row(batch, i, f"{path} row {index + i}") for i in range(batch.num_rows)]
        for row in rows:
            yield f"{path}:{index}", row
            index += 1


def _parquet_row(batch, i: int, where: str) -> dict | _BadRow:
    """Row `i` of a batch whose maps did not all convert to dicts, or a `_BadRow` naming the column
    and why: a dict holds each key once and only hashable keys, so a map with a repeated key or
    record keys is refused rather than silently losing entries."""
    row = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            row[name] = column.slice(i, 1).to_pylist(maps_as_pydicts="strict")[0]
        except KeyError as exc:
            found = re.search(r"duplicate key was (.+)\)", str(exc.args[0]))
            key = f"the key {found.group(1)}" if found else "a key"
            return _BadRow(f"{where}, column {name!r}: a map holds {key} twice; a map reaches the reward as a "
                           "dict, which holds each key once, so give each key once")
        except TypeError as exc:
            return _BadRow(f"{where}, column {name!r}: a map reaches the reward as a dict, whose keys must be "
                           f"text or numbers ({exc})")
    return row


def _example(row: dict, source: str, layout: str, prompt_column: str, renames: dict[str, str]) -> Example:
    where = _where(source)
    if prompt_column not in row:
        raise _BadRow(f"{where}: no column {prompt_column!r} for the prompt; the row has {sorted(row)}")
    prompt = _check_prompt(row[prompt_column], f"{where}, column {prompt_column!r}")
    found = {k: v for k, v in row.items() if k != prompt_column}
    if layout == "verl":
        reward_model = found.get("reward_model")
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise _BadRow(f"{where}, column 'reward_model': expected a record with 'ground_truth' "
                          f"(verl layout), got {_preview(reward_model)}")
        found["ground_truth"] = reward_model["ground_truth"]
    missing = [name for name in renames if name not in found]
    if missing:
        raise _BadRow(f"{where}: no column {missing[0]!r} to rename to {renames[missing[0]]!r}; "
                      f"the row has {sorted(found)}")
    taken = [column for column, name in renames.items() if name in found and name not in renames]
    if taken:  # the renamed column would replace one the row has under that name
        raise _BadRow(f"{where}: column {taken[0]!r} is renamed to {renames[taken[0]]!r}, which the row already "
                      f"has; rename one of them")
    kept = {k: v for k, v in found.items() if k not in renames}
    kept.update({renames[k]: v for k, v in found.items() if k in renames})
    return Example(prompt, kept, source)


def _check_prompt(prompt: object, where: str) -> str | list[dict]:
    """Plain text, or a non-empty list of {role, content} messages with text in both."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _BadRow(f"{where}: the prompt is empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        for i, message in enumerate(prompt):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise _BadRow(f"{where}: message {i} must be {{'role': str, 'content': str}}, "
                              f"got {_preview(message)}")
        return prompt
    raise _BadRow(f"{where}: expected a prompt string or a list of chat messages, got {_preview(prompt)}")


def _where(source: str) -> str:
    """'data.jsonl:7' -> 'data.jsonl line 7', 'data.parquet:7' -> 'data.parquet row 7'."""
    file, _, number = source.rpartition(":")
    return f"{file} {'line' if file.endswith('.jsonl') else 'row'} {number}"


def _preview(value: object, width: int = 80) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= width else text[:width] + '...'}"
