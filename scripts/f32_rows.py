"""Time float32 products over 1-1024 rows on the bench policy's weight shapes (12 layers: q|k|v, o, gate|up, down;
368 MB, beyond the last-level cache) by kernel: PyTorch's plain products (MKL), oneDNN's prepacked weights, and
tlt's AVX2 kernel (tlt/model/cpu_f32.py) where it builds, on the float32 weights and on them rounded to 4 bits
(`tlt_f32_q4`, a drafter's `drafter_bits=4`: 46 MB). Prints milliseconds for all 48 products, the float32
weight bytes a second and the arithmetic rate, medians of --repeats; --json writes them.

    python scripts/f32_rows.py --threads 2 --json f32_rows.json
"""

import argparse
import json

import torch
import torch.nn.functional as F

from tlt.bench.roofline import _median_seconds
from tlt.model import cpu_f32
from tlt.sft import PRESETS


def bench_shapes() -> list[tuple[int, int]]:
    """The bench preset's products, [out, in] each: q|k|v, o, gate|up and down of every layer."""
    p = PRESETS["bench"]
    hidden, heads = p["hidden_size"], p["num_attention_heads"] + 2 * p["num_key_value_heads"]
    layer = [(heads * p["head_dim"], hidden), (hidden, p["num_attention_heads"] * p["head_dim"]),
             (2 * p["intermediate_size"], hidden), (hidden, p["intermediate_size"])]
    return layer * p["num_hidden_layers"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default="1,2,4,5,8,9,16,32,64")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for o, i in bench_shapes()]
    nbytes = sum(w.numel() * 4 for w in weights)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    module = cpu_f32.kernels()
    ours = [cpu_f32.pack(w) for w in weights] if module is not None else None
    fours = [cpu_f32.pack4(w) for w in weights] if module is not None else None

    def products(name, xs):
        if name == "plain":
            return [F.linear(x, w) for x, w in zip(xs, weights)]
        if name == "onednn":
            return [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, onednn)]
        if name == "tlt_f32_q4":
            return [module.linear(x, c, w.shape[0], None, None, s) for x, (c, s), w in zip(xs, fours, weights)]
        return [module.linear(x, p, w.shape[0], None, None) for x, p, w in zip(xs, ours, weights)]

    names = ["plain", "onednn"] + (["tlt_f32", "tlt_f32_q4"] if module is not None else [])
    rows_out = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]
            record = {"rows": rows}
            for name in names:
                seconds = _median_seconds(lambda: products(name, xs), args.repeats)  # after one untimed call
                record[name] = {"ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9,
                                "gflop_s": 2 * rows * nbytes / 4 / seconds / 1e9}
            rows_out.append(record)
            print(f"rows {rows:3d}  " + "  ".join(f"{n} {record[n]['ms']:6.1f} ms ({record[n]['gb_s']:5.1f} GB/s, "
                                                    f"{record[n]['gflop_s']:6.1f} GFLOP/s)" for n in names), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "weight_bytes": nbytes, "torch": torch.__version__, "rows": rows_out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
