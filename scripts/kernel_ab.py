"""Two versions of tlt's bf16 CPU kernels side by side in one process: same bits, and which is faster.

    python scripts/kernel_ab.py OLD.cpp NEW.cpp [--attention B,S,T ...] [--heads H,KV,D] [--linear M ...] [--repeats 11]
                                [--old-keys natural] [--weight-sets N]

builds both sources as extensions of their own names (the first build of each takes a minute or two), then
  - checks that they give the same bits: attention over a paired bf16 cache (ragged rows, tree masks, 1 to 17
    new tokens a row) and products (1 to 300 rows, several shapes);
  - times them in turns, the order rotating every repeat so the host's drift hits both: attention of B rows x T
    new tokens over S cached ones through twelve layers' caches, products of M rows through twelve layers of
    the bench policy's four products. Each figure is the median over repeats (the first is a warm-up), and the
    ratio NEW / OLD the median of the per-repeat ratios (< 1: NEW is faster).
The shapes are the bench policy's (16 query heads over 8 kv heads of 48 dimensions; hidden 768, MLP 2560);
`--heads` sets the attention's (e.g. 32,8,128, a 7-8 B model's), for the bit checks and the timings alike.
The attention reads the keys in the layout the engine's cache keeps here (packed where the kernels run without AMX);
`--old-keys natural` hands OLD the same keys in the usual layout instead: for a source from before packed keys, or,
with one source as OLD and NEW, the packed layout against the usual one.
`--weight-sets N` runs the twelve layers' products over N distinct sets of weights in turn (default 12: every layer
its own, read from memory); with 1, one layer's weights (15 MB) serve all twelve and stay in the last-level cache,
which separates the products' arithmetic from the stream of their weights.
On the project's shared 2-core machine one run's ratios spread by a few percent: a change is worth keeping
when it holds over several runs. Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 48
PRODUCTS = ((768, 1536), (768, 768), (768, 5120), (2560, 768))  # (in, out): qkv, o, gate|up, down
LAYERS = 12


def triple(text: str, names: str = "B,S,T") -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected {names} (three positive integers), got {text!r}")
    return tuple(int(p) for p in parts)


def heads_triple(text: str) -> tuple[int, int, int]:
    H, KV, D = triple(text, "H,KV,D")
    if H % KV or D % 2 or D > 128:
        raise argparse.ArgumentTypeError(f"expected H,KV,D with H a multiple of KV and D even and at most 128, "
                                          f"got {text!r}")
    return H, KV, D


def build(source: Path, tag: str):
    """The extension built from `source` under a name of its own."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name=f"tlt_kernel_ab_{tag}_{source.stem}", sources=[str(source)],
                              extra_cflags=["-O3", "-fopenmp"], verbose=False)


def attention_case(B: int, S: int, T: int, ragged: bool, gen, heads=(HEADS, KV_HEADS, HEAD_DIM), old_keys="engine"):
    """The calls of one attention case for OLD and NEW, each (q, keys, values, mask, keyword arguments of the keys'
    layout): rows of S (ragged: S / 2 to S) cached tokens, T new ones a row whose tree mask lets each see itself and
    a random half of the others before it; `heads`: query heads, kv heads, head size. The cache's layout is the
    engine's here (packed keys where the kernels run without AMX); old_keys "natural": OLD's keys in the usual
    layout (a copy)."""
    import torch

    from tlt.model.kv_cache import KVCache, natural_keys

    H, KV, D = heads
    cache = KVCache(1, B, KV, D, dtype=torch.bfloat16, paired=True)
    cache.reserve(S + T)
    cache.store.normal_(generator=gen)
    lengths = torch.randint(max(1, S // 2), S + 1, (B,), generator=gen) if ragged else torch.full((B,), S)
    cache.lengths = lengths
    width = int(lengths.max()) + T
    allowed = torch.zeros(B, 1, T, width, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        allowed[b, 0, :, :n] = True
        allowed[b, 0, :, n : n + T] = (torch.rand(T, T, generator=gen) < 0.5).tril() | torch.eye(T, dtype=torch.bool)
    mask = torch.zeros(B, 1, T, width).masked_fill_(~allowed, float("-inf")) if T > 1 or ragged else None
    q = torch.randn(B, H, T, D, generator=gen).bfloat16()
    values = cache.values[0][:, :, :width]
    new = (q, cache.keys[0][:, :, :width], values, mask, {"packed_keys": True} if cache.packed_keys else {})
    if old_keys == "natural" and cache.packed_keys:  # (natural keys: any version's signature)
        return (q, natural_keys(cache.keys[0])[:, :, :width], values, mask, {}), new
    return new, new


def same_bits(modules, gen, heads=(HEADS, KV_HEADS, HEAD_DIM), old_keys="engine") -> dict[str, bool]:
    import torch

    from tlt.model import cpu_kernels

    out = {}
    for B, S, T, ragged in ((1, 5, 1, False), (3, 40, 1, True), (4, 100, 9, True), (2, 300, 9, False),
                            (5, 700, 1, True), (3, 257, 17, True), (3, 130, 5, False)):
        calls = attention_case(B, S, T, ragged, gen, heads, old_keys)
        a, b = (mod.attention(q, k, v, m, True, **layout) for mod, (q, k, v, m, layout) in zip(modules, calls))
        out[f"attention B={B} S={S} T={T}{' ragged' if ragged else ''}"] = torch.equal(a, b)
    for M in (1, 5, 16, 17, 48, 129, 225, 300):
        for K, N in ((768, 1536), (2560, 768), (512, 100)):
            w = cpu_kernels.pack((torch.randn(N, K, generator=gen) * 0.02).bfloat16())
            x = torch.randn(M, K, generator=gen).bfloat16()
            a, b = (mod.linear(x, w, N, None, None, None) for mod in modules)
            out[f"linear M={M} K={K} N={N}"] = torch.equal(a, b)
    return out


def timed(modules, run, repeats: int) -> dict:
    """run(i) timed for each module i in turns, the order rotating every repeat; repeat 0 warms up."""
    from tlt.bench import rotation

    seconds = [[] for _ in modules]
    for r in range(repeats + 1):
        for i in rotation(range(len(modules)), r):
            start = time.perf_counter()
            run(i)
            if r:
                seconds[i].append(time.perf_counter() - start)
    return {"old_ms": 1e3 * statistics.median(seconds[0]), "new_ms": 1e3 * statistics.median(seconds[1]),
            "new_over_old": statistics.median(b / a for a, b in zip(*seconds))}


def main(argv: list[str] | None = None, modules=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--attention", type=triple, nargs="*", default=[(25, 1000, 1), (25, 1000, 9)],
                        metavar="B,S,T")
    parser.add_argument("--heads", type=heads_triple, default=(HEADS, KV_HEADS, HEAD_DIM), metavar="H,KV,D",
                        help="the attention's query heads, kv heads and head size (default: the bench policy's)")
    parser.add_argument("--linear", type=int, nargs="*", default=[24, 216], metavar="M")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--old-keys", choices=("engine", "natural"), default="engine",
                        help="the keys' layout OLD's attention reads: the engine cache's here, or the usual layout")
    parser.add_argument("--weight-sets", type=int, default=LAYERS, metavar="N",
                        help=f"distinct weight sets the {LAYERS} layers' products take in turn (1: one layer's, cached)")
    args = parser.parse_args(argv)
    if not 1 <= args.weight_sets <= LAYERS:
        parser.error(f"--weight-sets: expected 1 to {LAYERS} distinct sets of weights, got {args.weight_sets}")
    for path in (args.old, args.new):
        if modules is None and not path.is_file():
            parser.error(f"{path}: no such source file")

    import torch

    from tlt.model import cpu_kernels

    torch.set_num_threads(args.threads)
    if modules is None:  # (a test passes built modules)
        modules = [build(args.old, "old"), build(args.new, "new")]
    gen = torch.Generator().manual_seed(0)
    bits = same_bits(modules, gen, args.heads, args.old_keys)
    result = {"same_bits": all(bits.values()), "differs": [k for k, same in bits.items() if not same],
              "attention": {}, "linear": {}}
    for B, S, T in args.attention:
        cases = [attention_case(B, S, T, True, gen, args.heads, args.old_keys) for _ in range(LAYERS)]
        result["attention"][f"{B},{S},{T}"] = timed(
            modules, lambda i: [modules[i].attention(q, k, v, m, True, **layout)
                                for q, k, v, m, layout in (calls[i] for calls in cases)], args.repeats)
    sets = [[(cpu_kernels.pack(torch.randn(N, K, generator=gen).bfloat16() * 0.02), N) for K, N in PRODUCTS]
            for _ in range(args.weight_sets)]
    weights = [sets[layer % args.weight_sets] for layer in range(LAYERS)]
    for M in args.linear:
        xs = [torch.randn(M, K, generator=gen).bfloat16() for K, _ in PRODUCTS]
        result["linear"][str(M)] = timed(
            modules, lambda i: [modules[i].linear(x, w, N, None, None, None) for layer in weights
                                for (w, N), x in zip(layer, xs)], args.repeats)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent))
    sys.exit(main())
