"""Smoke test of `tlt bench forward`: the measuring function runs on a tiny model and fills every key."""

import json
import math


from tlt.bench import forward
from tlt.io import atomic_write_json


def test_measure_fills_the_documented_record(hf_folder, tmp_path):
    _, folder = hf_folder("qwen3")
    record = forward.measure(folder, batch_sizes=[1, 2], prompt_len=8, repeats=1, command=["tlt", "bench", "forward"])
    atomic_write_json(tmp_path / "bench.json", record)
    record = json.loads((tmp_path / "bench.json").read_text())

    assert set(record) == {"config", "rows", "ratios"}
    config = record["config"]
    assert config["command"] == "tlt bench forward"
    assert (config["batch_sizes"], config["prompt_len"], config["repeats"]) == ([1, 2], 8, 1)
    assert [row["batch"] for row in record["rows"]] == [1, 2]
    for row in record["rows"]:
        for key in ("tlt_prefill_tok_s", "hf_prefill_tok_s", "prefill_vs_hf", "tlt_decode_ms", "hf_decode_ms", "decode_vs_hf"):
            assert math.isfinite(row[key]) and row[key] > 0, key
        assert row["prefill_max_abs_logit_diff"] <= 1e-4  # same weights, same model
    for name in ("prefill_vs_hf", "decode_vs_hf"):
        assert set(record["ratios"][name]) == {"1", "2"}
        assert all(v > 0 for v in record["ratios"][name].values())
    assert "ratio" in forward.format_table(record["rows"])


def test_batch_sizes_option_parses_a_list():
    import argparse

    parser = argparse.ArgumentParser()
    forward.add_arguments(parser)
    args = parser.parse_args(["--batch-sizes", "1,8,64", "--prompt-len", "16"])
    assert args.batch_sizes == [1, 8, 64] and args.prompt_len == 16 and args.model is None
