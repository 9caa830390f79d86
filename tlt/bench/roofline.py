"""Roofline of cached decoding: forward cost by new tokens and batch against this machine's memory bandwidth.

A decode step of a model larger than the last-level cache reads every weight once, so its floor is
weight bytes / read bandwidth (the "bandwidth limit"), and speculative decoding pays as far as a forward
over T new tokens costs about one over a single token. The bench measures, in one run:
  - the machine: read bandwidth (a sum over 1 GB of float32; once before and once per repeat, in the
    rotation with the forwards: the limit takes the median of the latter), and the best product throughput of the
    kernels available in the model's dtype: tlt's bf16 kernel (tlt/model/cpu_kernels.py) or, in float32 on a
    CPU without AVX-512, its float32 kernel (tlt/model/cpu_f32.py), prepacked
    oneDNN weights and plain `F.linear` at 1 row (GB/s of weight streamed, over weights larger than the
    cache) and at 256 rows (GFLOP/s); the bf16 throughput of AVX-512's dot products and, where AMX runs, of
    the tile unit, each on operands held in registers or tiles (no memory read: the ceiling of every product
    on that unit), and the tile unit fed one 1 KB tile load a product from L1 (the fewest loads any blocking
    on eight tiles takes: the ceiling of a product that reads its operands at all), tlt's 256-row products as a
    fraction of the unit they run on and of the fed tile unit, and the rows at which a
    product's arithmetic takes as long as streaming its weights (`tlt_kernel_balance_rows`);
  - the model, tlt and transformers on the same weights and dtype: one cached forward of T new tokens
    per row after P cached ones, at batch 1 for T = 1, 5, 9, 17, 33, and at batch 4, 16, 64 for T = 1;
    and the shares of tlt's one-token step spent in products and in attention (timed around each call);
    with `--grid`, the same split of each grid step (`summary.shares`).
Repeats alternate the systems and measurements (rotated each repeat) so drift hits all alike; each
timed forward follows an untimed one of the same system and shape; every figure is a median over repeats. `--model random-large` is a random Qwen3-shaped model of at least
128 MB in the chosen dtype and 12 layers, for the memory-bound regime without a trained checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from tlt.bench import rotation

NEW_TOKENS = (1, 5, 9, 17, 33)  # at batch 1
BATCHES = (4, 16, 64)  # at one new token
BANDWIDTH_BYTES = 1 << 30  # the array the read bandwidth is summed over
PRODUCT_WEIGHTS = (16, 4096, 2048)  # count and shape of the weights products stream: 256 MB in bf16
TILE_PEAK_ITERATIONS = 1 << 21  # of tile_peak's four tile products a thread: ~0.04 s on two cores of a Xeon with AMX
DOT_PEAK_ITERATIONS = 1 << 20  # of dot_peak's 24 AVX-512 bf16 products a thread: ~0.01 s at one a cycle
# About 174 M parameters: 12 layers of Qwen3's 0.6 B width (hidden 1024, 16 / 8 heads) with a 32 k
# vocabulary tied to the embedding; 348 MB in bf16, 11x this CPU's L3.
RANDOM_LARGE = dict(
    architecture="Qwen3ForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
    num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8, head_dim=64, qk_norm=True,
    tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.bench.forward import _positive_int

    parser.add_argument("--model", default="random-large",
                        help="model folder, built-in name, or random-large (default)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--prompt-len", type=_positive_int, default=200, help="cached tokens per row (P)")
    parser.add_argument("--repeats", type=_positive_int, default=7)
    parser.add_argument("--grid", type=grid_shapes, default=(), metavar="B,...:T,...",
                        help="also time every batch B with T new tokens a row (and with one), e.g. 4,8,16,32:3,5,9: "
                             "where a verification of T tokens costs about one token's step, speculation pays")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")


def grid_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """`B,...:T,...` as the (batch, new tokens) shapes of every B with every T and with 1."""
    parts = text.split(":")
    try:
        batches, tokens = ([int(x) for x in part.split(",")] for part in parts) if len(parts) == 2 else ([], [])
    except ValueError:
        batches, tokens = [], []
    if not batches or not tokens or min(batches + tokens) < 1:
        raise argparse.ArgumentTypeError(f"expected B,...:T,... (positive integers, e.g. 4,8,16:3,9), got {text!r}")
    return tuple((b, t) for b in sorted(set(batches)) for t in sorted(set(tokens) | {1}))


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_gb_s(seconds: float) -> float:
    """Read bandwidth of one sum over BANDWIDTH_BYTES that took `seconds`."""
    return BANDWIDTH_BYTES / seconds / 1e9


def step_limit_ms(weight_bytes: int, gb_s: float) -> float:
    """The bandwidth limit of one step: its weight bytes read at `gb_s`."""
    return 1e3 * weight_bytes / (gb_s * 1e9)


def machine_limits(dtype, repeats: int = 5) -> dict[str, float]:
    """Read bandwidth and the best product throughput of the available kernels in `dtype` (module docstring)."""
    import torch
    import torch.nn.functional as F

    from tlt.model import cpu_f32, cpu_kernels
    from tlt.model import packed as tlt_packed
    from tlt.model.packed import ONEDNN, ONEDNN_BF16

    data = torch.ones(BANDWIDTH_BYTES // 4)
    bandwidth = read_gb_s(_median_seconds(data.sum, repeats))
    del data
    count, rows, cols = PRODUCT_WEIGHTS
    weights = [torch.randn(rows, cols).to(dtype) for _ in range(count)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops_256 = 2 * 256 * sum(w.numel() for w in weights)
    one, many = torch.randn(1, cols).to(dtype), torch.randn(256, cols).to(dtype)
    out = {"bandwidth_gb_s": bandwidth}
    with torch.inference_mode():
        plain = {"plain": lambda x: [F.linear(x, w) for w in weights]}
        packs = ONEDNN_BF16 if dtype == torch.bfloat16 else ONEDNN  # no bf16 packing on an AVX2-only CPU
        if packs:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
            plain["onednn"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
        kernels = cpu_kernels.kernels() if dtype == torch.bfloat16 else None
        f32 = cpu_f32.kernels() if dtype == torch.float32 and tlt_packed.F32_KERNEL else None
        if kernels is not None:
            ours = [cpu_kernels.pack(w) for w in weights]
            plain["tlt_kernel"] = lambda x: [kernels.linear(x, p, rows, None, None) for p in ours]
        elif f32 is not None:  # float32 on a CPU without AVX-512: tlt's AVX2 kernel
            ours = [cpu_f32.pack(w) for w in weights]
            plain["tlt_kernel"] = lambda x: [f32.linear(x, p, rows, None, None) for p in ours]
        for name, run in plain.items():
            out[f"{name}_1_row_gb_s"] = nbytes / _median_seconds(lambda: run(one), repeats) / 1e9
            out[f"{name}_256_rows_gflop_s"] = flops_256 / _median_seconds(lambda: run(many), 3) / 1e9
        if kernels is not None:
            out["avx512_bf16_peak_gflop_s"] = peak_gflop_s(kernels.dot_peak, DOT_PEAK_ITERATIONS)
            if kernels.amx():
                out["amx_tile_peak_gflop_s"] = peak_gflop_s(kernels.tile_peak, TILE_PEAK_ITERATIONS)
                # the same with one 1 KB tile load a product (operands in L1): the most a product on tiles
                # can run at once its operands come from memory at all
                out["amx_fed_tile_peak_gflop_s"] = peak_gflop_s(lambda n: kernels.tile_peak(n, fed=True),
                                                                TILE_PEAK_ITERATIONS)
                out["tlt_kernel_256_rows_vs_fed_tile_peak"] = (out["tlt_kernel_256_rows_gflop_s"]
                                                               / out["amx_fed_tile_peak_gflop_s"])
            peak, name = (("amx_tile_peak_gflop_s", "tile_peak") if kernels.amx()
                          else ("avx512_bf16_peak_gflop_s", "avx512_peak"))
            out[f"tlt_kernel_256_rows_vs_{name}"] = out["tlt_kernel_256_rows_gflop_s"] / out[peak]
            # A product over R rows does R multiply-adds per bf16 weight (2 bytes): R FLOP per byte streamed, so
            # at about this many rows its arithmetic takes as long as reading its weights, and above it a forward
            # over more tokens costs more (speculation's verification stops being free). Bandwidth: the read
            # before the forwards (bandwidth_before_gb_s in the record).
            out["tlt_kernel_balance_rows"] = out["tlt_kernel_256_rows_gflop_s"] / bandwidth
        elif f32 is not None:  # R rows: R multiply-adds per float32 weight (4 bytes), R / 2 FLOP per byte
            out["tlt_kernel_balance_rows"] = 2 * out["tlt_kernel_256_rows_gflop_s"] / bandwidth
    return out


def peak_gflop_s(peak: Callable[[int], float], iterations: int, repeats: int = 3) -> float:
    """A unit's bf16 throughput on every thread from registers (no memory read): `peak` is the kernels'
    `dot_peak` (AVX-512) or `tile_peak` (AMX tiles), the compute ceiling of the products on that unit."""
    flops = peak(iterations)  # the same count every run
    return flops / _median_seconds(lambda: peak(iterations), repeats) / 1e9


def random_large(dtype, seed: int = 0):
    """A randomly initialised tlt model of shape RANDOM_LARGE in `dtype`."""
    import torch

    from tlt.model import ModelConfig, Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig(**RANDOM_LARGE)).to(dtype).eval()


def streamed_bytes(model) -> int:
    """Bytes of weight one decode step reads: every parameter but the embedding table, of which a
    step reads a few rows (its LM head counts where the two are tied)."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or tied)


class System:
    """One model under test: prefill B rows of P tokens once, then time forwards of T new tokens."""

    def __init__(self, name: str, model, prompt_len: int, vocab: int) -> None:
        self.name, self.model, self.prompt_len, self.vocab = name, model, prompt_len, vocab
        self.caches: dict[int, Any] = {}

    def prefill(self, batch: int, ids) -> None:
        raise NotImplementedError

    def forward(self, batch: int, new_ids) -> Callable[[], Any]:
        raise NotImplementedError


class TltSystem(System):
    def prefill(self, batch, ids):
        cache = self.model.new_cache(batch)
        self.model(ids, cache=cache)
        self.caches[batch] = cache

    def forward(self, batch, new_ids):
        cache = self.caches[batch]

        def run():
            cache.rollback(self.prompt_len)
            return self.model(new_ids, cache=cache).logits

        return run


class HFSystem(System):
    def prefill(self, batch, ids):
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.caches[batch] = getattr(self.model(ids, use_cache=True), self.cache_arg)

    def forward(self, batch, new_ids):
        past = copy.deepcopy(self.caches[batch])  # a fresh copy per timed forward, made outside the timing
        return lambda: self.model(new_ids, use_cache=True, **{self.cache_arg: past}).logits


def measure(model, hf, prompt_len: int, repeats: int, probe: Callable[[], Any] | None = None,
            grid: tuple[tuple[int, int], ...] = ()) -> tuple[list[dict[str, Any]], list[float]]:
    """Median ms of each (system, batch, new tokens) forward, the fixed shapes and `grid`'s; systems and
    shapes alternate per repeat.
    With `probe` (a read of BANDWIDTH_BYTES), one timed read per repeat joins the rotation: the read
    bandwidth in GB/s of each repeat comes back beside the rows, measured under the same load as the
    forwards (on a shared machine it moves with the neighbours' traffic, 26-52 GB/s here)."""
    import torch

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    shapes = base_shapes()
    shapes += [shape for shape in grid if shape not in shapes]
    systems = [TltSystem("tlt", model, prompt_len, vocab)]
    if hf is not None:
        systems.append(HFSystem("transformers", hf, prompt_len, vocab))
    ids = {b: torch.randint(vocab, (b, prompt_len), generator=gen) for b in {b for b, _ in shapes}}
    new = {shape: torch.randint(vocab, shape, generator=gen) for shape in shapes}
    samples: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        for system in systems:
            for b in ids:
                system.prefill(b, ids[b])
        cases: list = [(s, shape) for shape in shapes for s in systems] + ([None] if probe else [])
        bandwidth = []
        for r in range(repeats + 1):  # repeat 0 warms up (packs weights, grows caches)
            for case in rotation(cases, r):
                if case is None:
                    start = time.perf_counter()
                    probe()
                    if r:
                        bandwidth.append(read_gb_s(time.perf_counter() - start))
                    continue
                system, (b, t) = case
                # One untimed forward of the same system and shape first: a decode step follows steps of
                # its own model, not transformers' batch-64 forward (whose memory traffic otherwise lands
                # on whichever forward follows it in the rotation).
                system.forward(b, new[(b, t)])()
                run = system.forward(b, new[(b, t)])
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
                if r:
                    samples.setdefault((system.name, b, t), []).append(seconds)
    rows = [{"system": name, "batch": b, "new_tokens": t, "ms": 1e3 * statistics.median(s), "samples_ms": [1e3 * x for x in s]}
            for (name, b, t), s in samples.items()]
    return rows, bandwidth


def base_shapes() -> list[tuple[int, int]]:
    """The (batch, new tokens) shapes every run times."""
    return [(1, t) for t in NEW_TOKENS] + [(b, 1) for b in BATCHES]


def time_shares(model, prompt_len: int, steps: int = 10,
                shapes: tuple[tuple[int, int], ...] = ((1, 1),)) -> dict[tuple[int, int], dict[str, float]]:
    """For each (batch, new tokens a row) of `shapes`: the forward's wall time in ms (`ms`, mean of `steps`) and
    the shares of it spent in products (every `PackedLinear` call, whichever kernel runs it) and in attention,
    timed around each call. On tlt's kernels each layer's step runs its kernels one at a time
    (`cpu_kernels.layer_step_ops`, the same bits) so they can be timed; the timers make the step a little slower
    than the fused one. Each batch is prefilled once."""
    import torch

    from tlt.model import cpu_kernels, fused
    from tlt.model.packed import PackedLinear

    spent = {"products": 0.0, "attention": 0.0}

    def timed(fn, part):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[part] += time.perf_counter() - start
            return out
        return wrapper

    kernels = cpu_kernels.kernels() if model.dtype == torch.bfloat16 and model.device.type == "cpu" else None
    patches = [(PackedLinear, "__call__", "products"), (PackedLinear, "add", "products"), (fused, "attend", "attention")]
    if kernels is not None:
        patches.append((kernels, "attention", "attention"))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    if kernels is not None:
        originals.append((kernels, "layer_step", kernels.layer_step))
        ops = SimpleNamespace(linear=timed(kernels.linear, "products"), attention=timed(kernels.attention, "attention"),
                              rms_norm=kernels.rms_norm, rope_write=kernels.rope_write, silu_mul=kernels.silu_mul)
    vocab = model.config.vocab_size
    system = TltSystem("tlt", model, prompt_len, vocab)
    out = {}
    try:
        for owner, name, part in patches:
            setattr(owner, name, timed(getattr(owner, name), part))
        if kernels is not None:
            kernels.layer_step = lambda *args: cpu_kernels.layer_step_ops(ops, *args)
        with torch.inference_mode():
            for b in sorted({b for b, _ in shapes}):
                system.prefill(b, torch.randint(vocab, (b, prompt_len)))
                for t in sorted({t for batch, t in shapes if batch == b}):
                    run = system.forward(b, torch.randint(vocab, (b, t)))
                    run()
                    spent.update(products=0.0, attention=0.0)
                    start = time.perf_counter()
                    for _ in range(steps):
                        run()
                    total = time.perf_counter() - start
                    out[(b, t)] = {"ms": 1e3 * total / steps, **{part: s / total for part, s in spent.items()}}
                del system.caches[b]
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return out


def summarize(rows: list[dict], limit_ms: float, limits_ms: list[float]) -> dict[str, Any]:
    """Ratios the targets are stated in: cost of T tokens over 1, fraction of the bandwidth limit,
    speed over transformers; the `paired_` ones are medians of the ratio within each repeat (the two
    forwards, or the forward and the bandwidth read of `limits_ms`, measured in the same rotation), which
    a slow stretch of the machine moves less than a ratio of medians."""
    ms = {(r["system"], r["batch"], r["new_tokens"]): r["ms"] for r in rows}
    samples = {(r["system"], r["batch"], r["new_tokens"]): r["samples_ms"] for r in rows}
    one = ms[("tlt", 1, 1)]

    def paired(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b))

    out: dict[str, Any] = {
        "tlt_one_token_ms": one,
        "bandwidth_limit_ms": limit_ms,
        "one_token_vs_limit": one / limit_ms,
        "bandwidth_fraction": limit_ms / one,
        **{f"t{t}_vs_t1": ms[("tlt", 1, t)] / one for t in NEW_TOKENS[1:]},
        **{f"batch{b}_vs_batch1": ms[("tlt", b, 1)] / one for b in BATCHES},
        **{f"paired_t{t}_vs_t1": paired(samples[("tlt", 1, t)], samples[("tlt", 1, 1)]) for t in NEW_TOKENS[1:]},
        "paired_one_token_vs_limit": paired(samples[("tlt", 1, 1)], limits_ms),
    }
    base = base_shapes()
    grid = {(b, t) for (system, b, t) in ms if system == "tlt" and t > 1 and (b, t) not in base}
    if grid:
        # A step that verifies t tokens a row at batch b costs this many plain steps: speculation pays there only
        # where a step accepts more tokens a row than that (before the drafter's own cost).
        out["break_even_acceptance"] = {f"b{b}_t{t}": ms[("tlt", b, t)] / ms[("tlt", b, 1)] for b, t in sorted(grid)}
    if ("transformers", 1, 1) in ms:
        out["vs_transformers_batch1"] = ms[("transformers", 1, 1)] / one
        out["vs_transformers"] = {f"b{b}_t{t}": ms[("transformers", b, t)] / ms[("tlt", b, t)]
                                  for (s, b, t) in ms if s == "tlt"}
    return out


def format_table(rows: list[dict], limit_ms: float) -> str:
    ms = {(r["system"], r["batch"], r["new_tokens"]): r["ms"] for r in rows}
    systems = sorted({r["system"] for r in rows}, key=lambda s: s != "tlt")
    header = f"{'batch':>5} {'new':>4}" + "".join(f"  {s + ' ms':>16} {'x T=1':>6}" for s in systems) + f"  {'limit / tlt':>11}"
    lines = [header, "-" * len(header)]
    shapes = base_shapes()
    shapes += sorted({(b, t) for (_, b, t) in ms} - set(shapes))
    for b, t in shapes:
        cells = "".join(f"  {ms[(s, b, t)]:>16.2f} {ms[(s, b, t)] / ms[(s, 1, 1)]:>6.2f}" for s in systems)
        lines.append(f"{b:>5} {t:>4}{cells}  {limit_ms / ms[('tlt', b, t)]:>11.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    import tlt
    from tlt.bench.forward import _all_cores
    from tlt.errors import TltError
    from tlt.io import atomic_write_json
    from tlt.model.checkpoint import resolve_model_path

    torch.set_num_threads(args.threads or _all_cores())
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="tlt-bench-roofline-") as scratch:
        if args.model == "random-large":
            model = random_large(dtype)
            folder = Path(scratch) / "random-large"
            if not args.no_hf:
                model.save_pretrained(folder)
        else:
            folder = resolve_model_path(args.model)
            model = tlt.load_model(folder, dtype=args.dtype)
        most = max([*NEW_TOKENS, *(t for _, t in args.grid)])
        if args.prompt_len + most > model.config.max_position_embeddings:
            raise TltError(f"--prompt-len {args.prompt_len} + {most} new tokens exceed the model's "
                           f"max_position_embeddings ({model.config.max_position_embeddings})")
        hf = None
        if not args.no_hf:
            try:
                import transformers
                from transformers import AutoModelForCausalLM
            except ImportError as exc:
                raise TltError(f"transformers is needed for the comparison ({exc}); install tlt[hf] or pass --no-hf") from None
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
        weight_bytes = streamed_bytes(model)
        print(f"model {args.model}: {weight_bytes / 1e6:.0f} MB of weights per step in {args.dtype}, "
              f"{model.config.num_hidden_layers} layers; threads={torch.get_num_threads()}; measuring the machine ...")
        limits = machine_limits(dtype)
        data = torch.ones(BANDWIDTH_BYTES // 4)
        rows, bandwidth = measure(model, hf, args.prompt_len, args.repeats, probe=data.sum, grid=args.grid)
        del data
        # The limit takes the bandwidth read between the forwards; the figure read before them stays beside it.
        limits["bandwidth_before_gb_s"] = limits["bandwidth_gb_s"]
        limits["bandwidth_gb_s"] = statistics.median(bandwidth)
        limits["bandwidth_samples_gb_s"] = bandwidth
        limit_ms = step_limit_ms(weight_bytes, limits["bandwidth_gb_s"])
        shares = time_shares(model, args.prompt_len, shapes=((1, 1), *args.grid))
    for r in rows:
        r.update(model=args.model, dtype=args.dtype, weight_bytes=weight_bytes)
    summary = summarize(rows, limit_ms, [step_limit_ms(weight_bytes, gb_s) for gb_s in bandwidth])
    summary["product_share_one_token"] = shares[(1, 1)]["products"]
    summary["attention_share_one_token"] = shares[(1, 1)]["attention"]
    if args.grid:  # where each grid step's time goes
        summary["shares"] = {f"b{b}_t{t}": shares[(b, t)] for b, t in args.grid}
    print(" ".join(f"{k} {v:.1f}" for k, v in limits.items() if not isinstance(v, list)))
    print(f"bandwidth limit of one step: {limit_ms:.2f} ms (weight bytes / the median read bandwidth between the forwards); "
          f"cached tokens per row: {args.prompt_len}; medians of {args.repeats} alternating repeats")
    print(format_table(rows, limit_ms))
    if "break_even_acceptance" in summary:
        print("a step verifying T tokens a row costs this many one-token steps of its batch (speculation pays above it): "
              + ", ".join(f"{k} {v:.2f}" for k, v in summary["break_even_acceptance"].items()))
    if "shares" in summary:
        print("where a grid step goes (kernels timed one by one): " + ", ".join(
            f"{k} {v['ms']:.1f} ms, {100 * v['products']:.0f}% products, {100 * v['attention']:.0f}% attention"
            for k, v in summary["shares"].items()))
    print(f"tlt one token: {summary['one_token_vs_limit']:.2f}x the bandwidth limit "
          f"({100 * summary['bandwidth_fraction']:.0f}% of the read bandwidth), "
          f"{100 * summary['product_share_one_token']:.0f}% of it in products, "
          f"{100 * summary['attention_share_one_token']:.0f}% in attention; "
          + ", ".join(f"T={t}: {summary[f't{t}_vs_t1']:.2f}x T=1" for t in NEW_TOKENS[1:])
          + " (paired within repeats: " + ", ".join(f"T={t} {summary[f'paired_t{t}_vs_t1']:.2f}x" for t in NEW_TOKENS[1:])
          + f", one token {summary['paired_one_token_vs_limit']:.2f}x the limit)"
          + (f"; {summary['vs_transformers_batch1']:.2f}x faster than transformers at batch 1" if hf is not None else ""))
    record = {
        "config": {"command": shlex.join(sys.argv), "model": args.model, "dtype": args.dtype,
                   "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "repeats": args.repeats,
                   "grid": [list(shape) for shape in args.grid],
                   "weight_bytes": weight_bytes, "torch": torch.__version__,
                   "transformers": None if hf is None else transformers.__version__},
        **limits,
        "rows": rows,
        "summary": summary,
    }
    if args.json is not None:
        atomic_write_json(args.json, record)
        print(f"wrote {args.json}")
    return 0
