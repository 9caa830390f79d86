"""`tlt bench roofline` on a tiny model: the JSON fields its targets are read from, tlt against
transformers on the same weights, and the model choices it accepts."""

import argparse
import json
import statistics

import pytest
import torch

from tlt.bench import roofline


@pytest.fixture
def small_machine(monkeypatch):
    """Machine measurements over a few MB, so the test measures the shape of the output, not the machine."""
    monkeypatch.setattr(roofline, "BANDWIDTH_BYTES", 1 << 22)
    monkeypatch.setattr(roofline, "PRODUCT_WEIGHTS", (2, 256, 128))


def args_for(model, tmp_path, **overrides):
    fields = dict(model=str(model), dtype="float32", threads=1, prompt_len=8, repeats=2, no_hf=False, grid=(),
                  json=tmp_path / "roofline.json")
    fields.update(overrides)
    return argparse.Namespace(**fields)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_roofline_json_rows_for_tlt_and_transformers(hf_folder, tmp_path, small_machine, dtype):
    _, folder = hf_folder("qwen3", seed=1)
    assert roofline.run(args_for(folder, tmp_path, dtype=dtype)) == 0
    record = json.loads((tmp_path / "roofline.json").read_text())
    assert record["bandwidth_gb_s"] > 0 and record["plain_1_row_gb_s"] > 0 and record["bandwidth_before_gb_s"] > 0
    # one bandwidth read per repeat, between the forwards; the limit takes their median
    assert len(record["bandwidth_samples_gb_s"]) == 2
    assert record["bandwidth_gb_s"] == pytest.approx(statistics.median(record["bandwidth_samples_gb_s"]))
    rows = record["rows"]
    expected = {(1, t) for t in roofline.NEW_TOKENS} | {(b, 1) for b in roofline.BATCHES}
    for system in ("tlt", "transformers"):
        shapes = {(r["batch"], r["new_tokens"]) for r in rows if r["system"] == system}
        assert shapes == expected
    for r in rows:
        assert set(r) >= {"model", "dtype", "system", "weight_bytes", "batch", "new_tokens", "ms"}
        assert r["dtype"] == dtype and r["ms"] > 0 and len(r["samples_ms"]) == 2
    s = record["summary"]
    one = next(r["ms"] for r in rows if (r["system"], r["batch"], r["new_tokens"]) == ("tlt", 1, 1))
    assert s["tlt_one_token_ms"] == one
    assert s["bandwidth_fraction"] == pytest.approx(s["bandwidth_limit_ms"] / one)
    assert {"t9_vs_t1", "t17_vs_t1", "vs_transformers_batch1", "product_share_one_token", "paired_t17_vs_t1",
            "paired_one_token_vs_limit"} <= set(s)
    from tlt.model import cpu_kernels

    kernels = cpu_kernels.kernels() if dtype == "bfloat16" else None
    if kernels is not None:  # the products' rate is read against the ceiling of the unit they run on
        peak, ratio = (("amx_tile_peak_gflop_s", "tlt_kernel_256_rows_vs_tile_peak") if kernels.amx()
                       else ("avx512_bf16_peak_gflop_s", "tlt_kernel_256_rows_vs_avx512_peak"))
        # both are timings: their order is the benchmark's finding, not something a loaded machine keeps
        assert record[peak] > 0 and record["tlt_kernel_256_rows_gflop_s"] > 0
        assert record[ratio] == pytest.approx(record["tlt_kernel_256_rows_gflop_s"] / record[peak])
        assert record["avx512_bf16_peak_gflop_s"] > 0
        assert record["tlt_kernel_balance_rows"] == pytest.approx(
            record["tlt_kernel_256_rows_gflop_s"] / record["bandwidth_before_gb_s"])
    if kernels is not None and kernels.amx():  # the fed tile unit: the ceiling once operands are loaded
        assert record["amx_fed_tile_peak_gflop_s"] > 0
        assert record["tlt_kernel_256_rows_vs_fed_tile_peak"] == pytest.approx(
            record["tlt_kernel_256_rows_gflop_s"] / record["amx_fed_tile_peak_gflop_s"])
    if kernels is None or not kernels.amx():
        assert "amx_tile_peak_gflop_s" not in record and "amx_fed_tile_peak_gflop_s" not in record
    from tlt.model import cpu_f32, packed

    if dtype == "float32" and packed.F32_KERNEL and cpu_f32.kernels() is not None:  # a CPU without AVX-512
        assert record["tlt_kernel_1_row_gb_s"] > 0 and record["tlt_kernel_256_rows_gflop_s"] > 0
        assert record["tlt_kernel_balance_rows"] == pytest.approx(  # R / 2 FLOP per float32 byte
            2 * record["tlt_kernel_256_rows_gflop_s"] / record["bandwidth_before_gb_s"])
    elif dtype == "float32":
        assert "tlt_kernel_1_row_gb_s" not in record


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: tlt's kernels, their layer step one call at a time
def test_grid_times_each_batch_with_t_tokens_against_one(hf_folder, tmp_path, small_machine, dtype):
    _, folder = hf_folder("qwen3", seed=1)
    grid = roofline.grid_shapes("3,1:4")
    assert grid == ((1, 1), (1, 4), (3, 1), (3, 4))
    assert roofline.run(args_for(folder, tmp_path, no_hf=True, grid=grid, dtype=dtype)) == 0
    record = json.loads((tmp_path / "roofline.json").read_text())
    ms = {(r["batch"], r["new_tokens"]): r["ms"] for r in record["rows"]}
    assert set(ms) == set(roofline.base_shapes()) | set(grid)  # (1, 1) and (1, 4) once each
    assert len(record["rows"]) == len(ms)
    assert record["summary"]["break_even_acceptance"] == {
        "b1_t4": pytest.approx(ms[(1, 4)] / ms[(1, 1)]), "b3_t4": pytest.approx(ms[(3, 4)] / ms[(3, 1)])}
    assert record["config"]["grid"] == [list(shape) for shape in grid]
    shares = record["summary"]["shares"]  # every grid shape split into products and attention
    assert set(shares) == {"b1_t1", "b1_t4", "b3_t1", "b3_t4"}
    for split in shares.values():
        assert split["ms"] > 0 and split["products"] > 0 and split["attention"] > 0
        assert split["products"] + split["attention"] < 1


@pytest.mark.parametrize("text", ["4,8", "4:x", ":3", "0:3", "4,8:3:5", "4:-1"])
def test_grid_rejects_what_is_not_batches_colon_tokens(text):
    with pytest.raises(argparse.ArgumentTypeError, match="B,...:T,..."):
        roofline.grid_shapes(text)


def test_dot_peak_counts_the_operations_it_runs():
    from tlt.model import cpu_kernels

    kernels = cpu_kernels.kernels()
    if kernels is None:
        pytest.skip("needs tlt's bf16 kernels (AVX-512 bf16)")
    threads = torch.get_num_threads()
    # 24 products of 16 lanes x 2 pairs an iteration, on every thread
    assert kernels.dot_peak(10) == 2 * 32 * 24 * 10 * threads
    with pytest.raises(RuntimeError, match="iterations"):
        kernels.dot_peak(0)


def test_tile_peak_counts_the_operations_it_runs():
    from tlt.model import cpu_kernels

    kernels = cpu_kernels.kernels()
    if kernels is None or not kernels.amx():
        pytest.skip("needs tlt's bf16 kernels on a CPU with AMX")
    threads = torch.get_num_threads()
    # four 16 x 16 x 32 tile products an iteration, on every thread
    assert kernels.tile_peak(10) == 2 * 16 * 16 * 32 * 4 * 10 * threads
    assert kernels.tile_peak(10, fed=True) == 2 * 16 * 16 * 32 * 4 * 10 * threads  # the loads add no products
    with pytest.raises(RuntimeError, match="iterations"):
        kernels.tile_peak(0)
    with pytest.raises(RuntimeError, match="iterations"):
        kernels.tile_peak(0, fed=True)


def test_streamed_bytes_counts_a_tied_head_once(tiny_model):
    untied = tiny_model(seed=0)
    tied = tiny_model(seed=0, tie_word_embeddings=True)
    total = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())
    embed_bytes = untied.model.embed_tokens.weight.numel() * 4
    assert roofline.streamed_bytes(untied) == total(untied) - embed_bytes  # the table is looked up, not streamed
    assert roofline.streamed_bytes(tied) == total(tied)  # the same tensor is the LM head


def test_random_large_is_out_of_cache_and_deep_enough():
    """The regime the bench is for: at least 128 MB of bf16 weights and 12 layers (built on the meta
    device: only the shape matters here)."""
    from tlt.model import ModelConfig, Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(**roofline.RANDOM_LARGE)).to(torch.bfloat16)
    assert roofline.streamed_bytes(model) >= 128 * 2**20
    assert model.config.num_hidden_layers >= 12


def test_roofline_refuses_a_prompt_past_the_context(hf_folder, tmp_path, small_machine):
    from tlt.errors import TltError

    _, folder = hf_folder("llama", seed=2)
    with pytest.raises(TltError, match="--prompt-len 250"):
        roofline.run(args_for(folder, tmp_path, prompt_len=250, no_hf=True))


def test_paired_ratios_are_medians_of_the_ratios_within_each_repeat():
    """A forward slowed by the machine in one repeat moves the ratio of medians but not the paired one."""
    one = [10.0, 1.0, 2.0]  # ms of the one-token forward in three repeats
    slow = {17: [15.0, 1.5, 30.0]}  # T=17: 1.5x in two repeats, one slow outlier
    rows = [{"system": "tlt", "batch": 1, "new_tokens": t, "ms": statistics.median(slow.get(t, one)),
             "samples_ms": slow.get(t, one)} for t in roofline.NEW_TOKENS]
    rows += [{"system": "tlt", "batch": b, "new_tokens": 1, "ms": 2.0, "samples_ms": one} for b in roofline.BATCHES]
    s = roofline.summarize(rows, limit_ms=1.0, limits_ms=[5.0, 0.5, 4.0])
    assert s["t17_vs_t1"] == pytest.approx(7.5)  # 15 / 2
    assert s["paired_t17_vs_t1"] == pytest.approx(1.5)
    assert s["paired_t9_vs_t1"] == pytest.approx(1.0)
    assert s["paired_one_token_vs_limit"] == pytest.approx(2.0)  # 10/5, 1/0.5, 2/4
