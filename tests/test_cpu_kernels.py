"""tlt's bf16 CPU kernels (tlt/model/cpu_kernels.py): products and rms norm against float32 references,
rows independent of the row count, and the oneDNN path taken, with a warning, where they cannot run."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import tlt.model.packed as packed
from tlt.model import cpu_kernels

kernels = cpu_kernels.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="tlt's bf16 CPU kernels do not run on this machine")


def test_the_kernels_load_where_the_cpu_runs_them():
    """Where the CPU has AVX-512 BF16 and the kernels are not turned off, they build and load: a compile
    error would otherwise turn every kernel test below into a skip."""
    flags = cpu_kernels.cpu_flags() or {"avx512_bf16"}  # not Linux: the module's own probe decides
    if os.environ.get(cpu_kernels.ENV, "1") == "0" or "avx512_bf16" not in flags:
        pytest.skip("this CPU has no AVX-512 BF16, or TLT_CPU_KERNELS=0")
    assert kernels is not None, cpu_kernels._reason


def units() -> list[bool]:
    """The units the kernels have here, as `on_unit` takes them: AMX tiles where they run, then AVX-512 alone."""
    return [True, False] if kernels.amx() else [False]


@contextlib.contextmanager
def on_unit(tiles: bool):
    """The kernels on AMX tiles (where they run) or AVX-512 alone inside the block; AMX on again after it."""
    kernels.set_amx(tiles)
    try:
        yield
    finally:
        kernels.set_amx(True)


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_kernels
@pytest.mark.parametrize("M,K,N", [(1, 64, 64), (5, 48, 100), (6, 128, 130), (7, 96, 1), (13, 64, 33), (49, 64, 200),
                                   (100, 32, 64), (40, 1024, 64), (150, 768, 40)])
def test_linear_matches_float32_and_rows_do_not_depend_on_the_row_count(M, K, N):
    """Shapes around the kernel's blocks (up to 12 rows per register block, split evenly; 48 rows per
    task; 32 columns per weight group; on AMX tiles 16-row blocks, 128 rows per task, k in slices of 256, a
    partial last block padded): within bf16 rounding of the float32 product, and every row bit for bit the same
    whether multiplied alone or with the others."""
    x, w, residual = bf16(M, K, seed=1), bf16(N, K, seed=2), bf16(M, N, seed=3)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(4))
    weight = cpu_kernels.pack(w)
    assert weight.shape == (-(-N // 32), K // 2, 32, 2)
    out = kernels.linear(x, weight, N, bias, residual)
    exact = x.float() @ w.float().t() + bias + residual.float()
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert (out.float() - exact).abs().max() <= 0.01 * exact.abs().max()
    for i in range(M):
        assert torch.equal(kernels.linear(x[i : i + 1], weight, N, bias, residual[i : i + 1])[0], out[i])
    plain = kernels.linear(x, weight, N, None, None)
    assert (plain.float() - x.float() @ w.float().t()).abs().max() <= 0.01 * exact.abs().max()


@needs_kernels
@pytest.mark.parametrize("M,K,N", [(1, 256, 64), (2, 768, 100), (5, 128, 33), (13, 384, 70), (49, 256, 40), (3, 100, 32),
                                   (4, 192, 64), (2, 96, 40)])
def test_four_bit_linear_multiplies_by_the_unpacked_weight_and_rows_do_not_depend_on_the_row_count(M, K, N):
    """4-bit weights (groups of 128 inputs; 64 for K = 192, 32 for K = 96, one for K = 100): the product
    equals x times the weight the codes stand for (`unpack4`) within bf16 rounding, with bias and residual,
    every row the same bit for bit alone or among others; the rounded weight is within half a level of the
    original."""
    x, w, residual = bf16(M, K, seed=11), bf16(N, K, seed=12), bf16(M, N, seed=13)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(14))
    codes, scales = cpu_kernels.pack4(w)
    kgroups = K // next((g for g in cpu_kernels.QGROUPS if K % g == 0), K)
    assert codes.dtype == torch.uint8 and codes.shape == (-(-N // 32), K // 2, 32)
    assert scales.shape == (-(-N // 32), kgroups, 2, 32)
    rounded = cpu_kernels.unpack4(codes, scales, N)
    level = (w.float().view(N, kgroups, -1).amax(-1) - w.float().view(N, kgroups, -1).amin(-1)) / 15
    assert ((rounded - w.float()).view(N, kgroups, -1).abs() <= level[..., None] / 2 * 1.001 + 1e-7).all()
    out = kernels.linear(x, codes, N, bias, residual, scales)
    exact = x.float() @ rounded.t() + bias + residual.float()
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert (out.float() - exact).abs().max() <= 0.01 * exact.abs().max()
    for i in range(M):
        assert torch.equal(kernels.linear(x[i : i + 1], codes, N, bias, residual[i : i + 1], scales)[0], out[i])
    with pytest.raises(RuntimeError, match="scales"):
        kernels.linear(x, codes, N, None, None)


def test_four_bit_codes_of_evenly_spaced_weights_are_exact():
    """A weight that takes 16 evenly spaced values in each group of 128 inputs is stored exactly."""
    gen = torch.Generator().manual_seed(15)
    low, step = torch.randn(64, 2, 1, generator=gen), torch.rand(64, 2, 1, generator=gen) + 0.1
    levels = torch.randint(0, 16, (64, 2, 128), generator=gen)
    levels[..., 0], levels[..., 1] = 0, 15
    w = (low + step * levels).view(64, 256)
    assert torch.allclose(cpu_kernels.unpack4(*cpu_kernels.pack4(w), 64), w, rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.skipif(kernels is None or not kernels.amx(), reason="this CPU has no AMX (or the OS does not grant it)")
@pytest.mark.parametrize("M,K,N", [(1, 64, 64), (9, 768, 100), (16, 256, 130), (17, 512, 33), (49, 64, 200)])
def test_amx_tiles_agree_with_the_avx512_blocks(M, K, N):
    """Where the CPU has AMX, products whose K is a multiple of 32 take its tiles at every row count (the
    row-count test above then checks the tiles): within bf16 rounding of the AVX-512 blocks, and both
    within it of the float32 product."""
    x, w, residual = bf16(M, K, seed=21), bf16(N, K, seed=22), bf16(M, N, seed=23)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(24))
    weight = cpu_kernels.pack(w)
    try:
        tiles = kernels.linear(x, weight, N, bias, residual)
        kernels.set_amx(False)
        blocks = kernels.linear(x, weight, N, bias, residual)
    finally:
        kernels.set_amx(True)
    exact = x.float() @ w.float().t() + bias + residual.float()
    for out in (tiles, blocks):
        assert (out.float() - exact).abs().max() <= 0.01 * exact.abs().max()
    assert (tiles.float() - blocks.float()).abs().max() <= 0.01 * exact.abs().max()


@needs_kernels
@pytest.mark.skipif(kernels is None or not kernels.amx(), reason="this CPU has no AMX (or the OS does not grant it)")
@pytest.mark.parametrize("D", [12, 48, 64, 128])
def test_attention_scores_on_amx_tiles_agree_with_the_avx512_blocks(D):
    """The scores on the tiles pad queries and keys to a multiple of 32 dimensions with zeros: within
    bf16 rounding of the AVX-512 blocks' attention, masked and causal, over a bf16 cache."""
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(2, 4, 5, D, generator=gen).bfloat16()
    keys = torch.randn(2, 2, 37, D, generator=gen).bfloat16()
    values = torch.randn(2, 2, 37, D, generator=gen).bfloat16()
    allowed = torch.rand(2, 1, 5, 37, generator=gen) < 0.8
    allowed[..., 0] = True
    mask = torch.full(allowed.shape, float("-inf")).masked_fill_(allowed, 0.0)
    for m in (mask, None):
        try:
            tiles = kernels.attention(q, keys, values, m)
            kernels.set_amx(False)
            blocks = kernels.attention(q, keys, values, m)
        finally:
            kernels.set_amx(True)
        assert (tiles.float() - blocks.float()).abs().max() <= 0.02 * blocks.float().abs().max()


@needs_kernels
def test_linear_refuses_mismatched_inputs():
    weight = cpu_kernels.pack(bf16(64, 32))
    with pytest.raises(RuntimeError, match="columns"):
        kernels.linear(bf16(2, 30), weight, 64, None, None)
    with pytest.raises(RuntimeError, match="N does not match"):
        kernels.linear(bf16(2, 32), weight, 65, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear(bf16(2, 32), weight, 64, bf16(64), None)
    with pytest.raises(RuntimeError, match="residual"):
        kernels.linear(bf16(2, 32), weight, 64, None, bf16(3, 64))


@needs_kernels
def test_rms_norm_matches_float32_on_strided_heads():
    """The per-head q/k norm reads a slice of the stacked q|k|v output (rows of D contiguous, heads
    strided) with one weight per head; the hidden-state norm has no weight."""
    qkv = bf16(3, 7, 48, seed=5)
    heads = qkv[:, :5]  # [3, 5, 48] of [3, 7, 48]
    weight = torch.rand(5, 48, generator=torch.Generator().manual_seed(6)) + 0.5
    out = kernels.rms_norm(heads, weight, 1e-6)
    exact = F.rms_norm(heads.float(), (48,), None, 1e-6) * weight
    assert out.is_contiguous() and (out.float() - exact).abs().max() <= 0.01 * exact.abs().max()
    hidden = bf16(1, 4, 200, seed=7)
    exact = F.rms_norm(hidden.float(), (200,), None, 1e-5)
    assert (kernels.rms_norm(hidden, None, 1e-5).float() - exact).abs().max() <= 0.01 * exact.abs().max()
    # a verification's hundreds of rows split across threads: each row the same bits as alone
    many = bf16(2, 300, 768, seed=8)
    out = kernels.rms_norm(many, None, 1e-6)
    exact = F.rms_norm(many.float(), (768,), None, 1e-6)
    assert (out.float() - exact).abs().max() <= 0.01 * exact.abs().max()
    for a, r in ((0, 0), (0, 299), (1, 150), (1, 299)):
        assert torch.equal(kernels.rms_norm(many[a : a + 1, r : r + 1], None, 1e-6)[0, 0], out[a, r])


@needs_kernels
def test_packed_linear_takes_the_kernel_for_bf16_only(monkeypatch):
    """bf16 CPU weights of an even input size go to the kernel; float32 and odd input sizes do not, and
    with the kernel turned off bf16 takes oneDNN's prepacked weights."""
    w = bf16(96, 64)
    linear = packed.PackedLinear(w)
    assert linear.kernels is not None and linear.packed
    assert packed.PackedLinear(w.float()).kernels is None
    assert packed.PackedLinear(bf16(96, 63)).kernels is None
    x = bf16(3, 64, seed=9)
    exact = x.float() @ w.float().t()
    assert (linear(x[None]).float()[0] - exact).abs().max() <= 0.01 * exact.abs().max()
    monkeypatch.setattr(packed, "KERNELS", False)
    onednn = packed.PackedLinear(w)
    assert onednn.kernels is None and onednn.packed == packed.ONEDNN_BF16
    assert (onednn(x).float() - exact).abs().max() <= 0.01 * exact.abs().max()


def test_turned_off_kernels_warn_with_the_reason_and_bf16_decodes_on_onednn():
    """TLT_CPU_KERNELS=0 (as a machine without AVX-512 BF16 or a compiler): no kernel, a warning that
    names why and the path bf16 products take instead, and a bf16 model still decodes."""
    code = """
import warnings, torch
warnings.simplefilter("always")
from tlt.model import cpu_kernels, packed
with warnings.catch_warnings(record=True) as caught:
    assert cpu_kernels.kernels() is None
    assert packed.PackedLinear(torch.ones(8, 8, dtype=torch.bfloat16)).kernels is None
print(packed.ONEDNN_BF16, "|".join(str(w.message) for w in caught))
"""
    env = {**os.environ, "TLT_CPU_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    onednn_bf16, _, text = done.stdout.strip().partition(" ")
    messages = text.split("|")
    assert len(messages) == 1 and "TLT_CPU_KERNELS=0" in messages[0]
    # the path bf16 takes instead: oneDNN's packed weights, or on an AVX2-only CPU PyTorch's plain products
    path = "bf16 products use oneDNN" if onednn_bf16 == "True" else "PyTorch's plain ones"
    assert path in messages[0], messages[0]


@needs_kernels
@pytest.mark.parametrize("B,H,Hkv,T,S,D,masked", [(1, 16, 8, 1, 200, 48, False), (2, 4, 2, 5, 30, 12, True),
                                                  (3, 8, 8, 4, 50, 64, True), (1, 4, 2, 7, 7, 48, False),
                                                  (2, 6, 2, 3, 41, 128, True)])
def test_attention_matches_sdpa_and_queries_do_not_depend_on_each_other(B, H, Hkv, T, S, D, masked):
    """bf16 queries over float32 keys/values that are a slice of a larger cache (causal without a mask,
    a random mask that keeps each query's own key otherwise), against float32 SDPA; each query's row
    is the same bit for bit when it is the forward's only query."""
    gen = torch.Generator().manual_seed(T * S)
    q = torch.randn(B, H, T, D, generator=gen).bfloat16()
    k, v = (torch.randn(B, Hkv, S + 3, D, generator=gen)[:, :, :S] for _ in range(2))
    mask = None
    if masked:
        allowed = torch.rand(B, 1, T, S, generator=gen) > 0.3
        allowed[..., S - T:] |= torch.eye(T, dtype=torch.bool)
        mask = torch.full(allowed.shape, float("-inf")).masked_fill_(allowed, 0.0)
    out = kernels.attention(q, k, v, mask)
    exact = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=H != Hkv).transpose(1, 2).reshape(B, T, H * D)
    assert out.shape == (B, T, H * D) and (out.float() - exact).abs().max() <= 0.02 * exact.abs().max()
    t = T - 1  # the last query alone sees the same keys (causal: all of them; masked: its mask row)
    alone = kernels.attention(q[:, :, t:], k, v, None if mask is None else mask[:, :, t:])
    assert torch.equal(alone[:, 0], out[:, t])


@needs_kernels
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("D", [16, 40])
@pytest.mark.parametrize("pair,pack", [(False, False), (True, False), (True, True)])
def test_rope_write_matches_the_reference_ops(norm, D, pair, pack):
    """q/k norm + RoPE + cache write in one kernel against the operators the reference layer runs
    (bf16 norm, bf16 rotation, `KVCache.write`), on rows of unequal length, into a float32 cache and a bf16
    one with paired values, its keys in the usual or the packed layout: q and the written keys agree within one
    bf16 rounding, values are copied exactly, and no other slot of the cache changes."""
    from tlt.model.fused import _qk_normed
    from tlt.model.kv_cache import KVCache, natural, natural_keys
    from tlt.model.rope import apply_rope, rope_tables

    B, T, H, Hkv = 2, 3, 4, 2
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(B, T, H + 2 * Hkv, D, generator=gen).bfloat16()
    weight = torch.rand(H + Hkv, D, generator=gen) + 0.5
    lengths = torch.tensor([5, 2])
    cos, sin = rope_tables(lengths[:, None] + torch.arange(T), 1.0 / 10000 ** (torch.arange(0, D, 2) / D), 1.0,
                           torch.bfloat16)
    caches = []
    for _ in range(2):
        cache = KVCache(1, B, Hkv, D, dtype=torch.bfloat16 if pair else torch.float32, paired=pair, packed_keys=pack)
        cache.reserve(8)
        cache.store.normal_(generator=torch.Generator().manual_seed(12))
        cache.lengths = lengths.clone()
        caches.append(cache)
    keys, values, S = caches[0].buffers(0, T)
    q = kernels.rope_write(qkv, H, weight if norm else None, 1e-6, cos.reshape(B, T, D), sin.reshape(B, T, D), keys,
                           values, caches[0].lengths, pair, pack)
    if pair:
        values = natural(values)
    if pack:
        keys = natural_keys(keys)
    qk = qkv[:, :, : H + Hkv]
    if norm:
        fused = type("Fused", (), {"qkv": type("P", (), {"kernel": None})(), "qk_eps": 1e-6,
                                   "qk_norm": weight.bfloat16()})()
        qk = _qk_normed(fused, qk)
    qk = apply_rope(qk, cos, sin).transpose(1, 2)
    ref_k, ref_v = caches[1].write(0, qk[:, H:], qkv[:, :, H + Hkv :].transpose(1, 2))
    assert S == 8 and q.shape == (B, H, T, D)
    tol = 0.02 * qk.float().abs().max()
    assert (q.float() - qk[:, :H].float()).abs().max() <= tol
    assert (keys[:, :, :S] - ref_k).abs().max() <= tol
    assert torch.equal(values[:, :, :S], ref_v)
    new = torch.zeros(B, 1, keys.shape[2], 1, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        new[b, 0, n : n + T] = True
    untouched = natural_keys(caches[1].keys[0]) if pack else caches[1].keys[0]
    assert torch.equal(keys.masked_select(~new), untouched.masked_select(~new))  # the rest untouched
    untouched = natural(caches[1].values[0]) if pair else caches[1].values[0]
    assert torch.equal(values.masked_select(~new), untouched.masked_select(~new))


@needs_kernels
def test_attention_of_a_tree_node_equals_its_plain_decoding_bit_for_bit():
    """A tree draft's node attends to its ancestors among draft slots with other nodes masked between;
    plain decoding later reads the same keys packed one after another. The kernel gives both the same
    bits (the greedy and seeded equality of tree speculation and plain decoding rest on it)."""
    gen = torch.Generator().manual_seed(21)
    H, Hkv, D, n = 4, 2, 48, 37
    keys, values = torch.randn(1, Hkv, n + 9, D, generator=gen), torch.randn(1, Hkv, n + 9, D, generator=gen)
    q = torch.randn(1, H, 1, D, generator=gen).bfloat16()
    seen = [*range(n), n + 2, n + 5, n + 8]  # the cache, two ancestors and the node itself
    allowed = torch.zeros(1, 1, 1, n + 9, dtype=torch.bool)
    allowed[..., seen] = True
    mask = torch.full(allowed.shape, float("-inf")).masked_fill_(allowed, 0.0)
    tree = kernels.attention(q, keys, values, mask)
    plain = kernels.attention(q, keys[:, :, seen].contiguous(), values[:, :, seen].contiguous(), None)
    assert torch.equal(tree, plain)


def paired(values: torch.Tensor) -> torch.Tensor:
    """values [B, H, S, D] in the kernels' paired layout, in a buffer of an even slot count (a view of S slots)."""
    B, H, S, D = values.shape
    even = S + S % 2
    padded = F.pad(values, (0, 0, 0, even - S))
    return padded.view(B, H, even // 2, 2, D).transpose(-1, -2).contiguous().view(B, H, even, D)[:, :, :S]


def packed_keys(keys: torch.Tensor) -> torch.Tensor:
    """bf16 keys [B, H, S, D] as a cache keeps them `packed_keys`, in a buffer of whole groups of 32 slots (a view of
    S slots); the slots past S hold large finite garbage, which the attention must never weigh."""
    from tlt.model.kv_cache import KEY_GROUP, key_slots

    B, H, S, D = keys.shape
    whole = -(-S // KEY_GROUP) * KEY_GROUP
    padded = F.pad(keys, (0, 0, 0, whole - S), value=1e4)
    out = torch.empty(B, H, whole, D, dtype=torch.bfloat16)
    key_slots(out)[:] = padded.view(B, H, whole // KEY_GROUP, KEY_GROUP, D // 2, 2)
    return out[:, :, :S]


def tree_visibility(parents: list[int], n: int) -> tuple[list[list[int]], torch.Tensor]:
    """For a draft tree (node j's parent, -1 for the root) written after n cached keys: the slots each node
    sees (the cache, then its path from the root) and the additive mask [1, 1, T, n + T] of a verification."""
    T = len(parents)
    seen = []
    for j in range(T):
        path, a = [], j
        while a >= 0:
            path.append(n + a)
            a = parents[a]
        seen.append([*range(n), *reversed(path)])
    allowed = torch.zeros(1, 1, T, n + T, dtype=torch.bool)
    for j, slots in enumerate(seen):
        allowed[0, 0, j, slots] = True
    return seen, torch.full(allowed.shape, float("-inf")).masked_fill_(allowed, 0.0)


@needs_kernels
@pytest.mark.parametrize("D", [48, 128, 40])
@pytest.mark.parametrize("S", [9, 65, 200])
def test_attention_over_paired_values(D, S):
    """Values in the paired layout (what a bf16 cache on the CPU holds): with D a multiple of 16, bf16-rounded
    weights over the values as they lie (AMX tiles or VDPBF16PS) up to a split, within a bf16 rounding of float32
    attention; otherwise (or where no row sees enough keys for a split) the same bits as the usual layout (the same
    float32 sums in slot order)."""
    gen = torch.Generator().manual_seed(D * S)
    B, H, Hkv = 3, 4, 2
    for T in (1, 9):
        keys = torch.randn(B, Hkv, S, D, generator=gen).bfloat16()
        values = torch.randn(B, Hkv, S, D, generator=gen).bfloat16()
        q = torch.randn(B, H, T, D, generator=gen).bfloat16()
        mask = torch.where(torch.rand(B, 1, T, S, generator=gen) < 0.9, 0.0, float("-inf"))
        mask[..., 0] = 0.0
        trailing = torch.zeros(B, 1, T, S)  # only the last keys hidden: the bf16 sums carry the rest
        trailing[..., S - 3 :] = float("-inf")
        for m in (None, mask, trailing):
            got = kernels.attention(q, keys, paired(values), m, True)
            ref = F.scaled_dot_product_attention(q.float(), keys.float().repeat_interleave(H // Hkv, 1),
                                                 values.float().repeat_interleave(H // Hkv, 1), attn_mask=m,
                                                 is_causal=m is None and T > 1)
            if m is None and T > 1:  # the kernel's causal mask is over the last T keys
                causal = torch.full((T, S), float("-inf")).triu(S - T + 1)
                ref = F.scaled_dot_product_attention(q.float(), keys.float().repeat_interleave(H // Hkv, 1),
                                                     values.float().repeat_interleave(H // Hkv, 1), attn_mask=causal)
            ref = ref.transpose(1, 2).reshape(B, T, H * D)
            assert (got.float() - ref).abs().max() <= 0.01
            if D % 16 or S < 96:  # no bf16 sums (no row sees the 96 keys a split needs): the usual layout's bits
                for tiles in units():
                    if tiles and D % 16 == 0:  # tile scores of a paired cache's keys may differ from packed ones
                        continue
                    with on_unit(tiles):
                        assert torch.equal(kernels.attention(q, keys, paired(values), m, True),
                                           kernels.attention(q, keys, values, m))


@needs_kernels
@pytest.mark.parametrize("D", [16, 32, 48, 64, 128])
def test_attention_over_paired_values_gives_each_query_its_own_bits_at_any_query_count(D):
    """Over a bf16 cache with paired values, 2, 18 and 34 query rows a kv head (a step, a 9-token draft and a
    17-token one, two heads a kv head: one, two and three blocks of 16 queries on AMX tiles, with the last 32
    dimensions whole or half a tile): every query's row is the bits it gets alone."""
    gen = torch.Generator().manual_seed(D)
    B, H, Hkv, S = 2, 4, 2, 150
    keys = torch.randn(B, Hkv, S, D, generator=gen).bfloat16()
    values = paired(torch.randn(B, Hkv, S, D, generator=gen).bfloat16())
    for T in (9, 17):
        q = torch.randn(B, H, T, D, generator=gen).bfloat16()
        allowed = torch.rand(B, 1, T, S, generator=gen) > 0.2
        allowed[..., S - T:] |= torch.eye(T, dtype=torch.bool)
        mask = torch.full(allowed.shape, float("-inf")).masked_fill_(allowed, 0.0)
        out = kernels.attention(q, keys, values, mask, True)
        for t in (0, T // 2, T - 1):
            alone = kernels.attention(q[:, :, t:t + 1], keys, values, mask[:, :, t:t + 1], True)
            assert torch.equal(alone[:, 0], out[:, t]), (T, t)


@needs_kernels
@pytest.mark.parametrize("D", [16, 40, 48, 128])
@pytest.mark.parametrize("S", [9, 65, 200])
def test_attention_over_packed_keys_equals_the_usual_layout(D, S):
    """Keys packed as a cache keeps them without AMX (32 slots a weight group, read in place; garbage past S): on
    AVX-512 the same bits as the usual layout (the same products as the keys packed per call), over values in the
    usual and the paired layout, with no mask, a mask and rows of different lengths, one to 17 queries a row; on
    AMX tiles within a bf16 rounding of it (the scores then take the AVX-512 block). A buffer that does not hold the
    last group whole is refused."""
    gen = torch.Generator().manual_seed(7 * D + S)
    B, H, Hkv = 3, 4, 2
    for T in (1, 9, 17):
        if T > S:
            continue
        keys = torch.randn(B, Hkv, S, D, generator=gen).bfloat16()
        values = torch.randn(B, Hkv, S, D, generator=gen).bfloat16()
        q = torch.randn(B, H, T, D, generator=gen).bfloat16()
        mask = torch.where(torch.rand(B, 1, T, S, generator=gen) < 0.9, 0.0, float("-inf"))
        mask[..., 0] = 0.0
        ragged = mask.clone()
        ragged[1, ..., S // 2 :] = float("-inf")  # a shorter row
        for pair in (False, True):
            lay = paired if pair else (lambda v: v)
            for m in (None, mask, ragged):
                for tiles in units():
                    with on_unit(tiles):
                        usual = kernels.attention(q, keys, lay(values), m, pair)
                        packed_out = kernels.attention(q, packed_keys(keys), lay(values), m, pair, None, True)
                    if tiles:
                        assert (packed_out.float() - usual.float()).abs().max() <= 0.02
                    else:
                        assert torch.equal(packed_out, usual), (T, pair, m is None)
    short = torch.zeros(1, Hkv, S, D, dtype=torch.bfloat16)  # S slots, not whole groups of 32
    if S % 32:
        with pytest.raises(RuntimeError, match="whole groups"):
            kernels.attention(q[:1], short, values[:1], None, False, None, True)


@needs_kernels
@pytest.mark.parametrize("n", [15, 16, 31, 33, 64, 124, 156, 200])
@pytest.mark.parametrize("group,half,pair,pack", [(2, True, False, False), (8, True, False, False),
                                                  (8, False, False, False), (2, True, True, False),
                                                  (8, True, True, False), (2, True, True, True), (8, True, True, True)])
@pytest.mark.parametrize("D", [48, 64, 128])
def test_every_node_of_a_tree_verification_equals_plain_decoding_bit_for_bit(n, group, half, pair, pack, D):
    """A whole tree's verification (nine nodes of several branches, several query heads per kv head, so
    the values take more than one pass) against each node decoded alone over its cache and ancestors
    packed one after another, over values in the usual and in the paired layout (paired: bf16 sums, on the
    tiles or VDPBF16PS, up to a split that must fall where plain decoding's does; head sizes whose sums take
    passes of 8, 6 and 2 rows) and keys in the usual and the packed layout, on every unit; one cached key every
    node sees has a weight of exactly zero
    (its additive mask -500), so the weights' sum meets a zero among the weights it adds. A sum that depended on
    where the keys sit would differ in the last float32 bit, which the bf16 output shows only now and then:
    hence many heads, wide heads and several draws."""
    Hkv = 4
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5]  # node j's parent; node 0 is the root
    T = len(parents)
    dtype = torch.bfloat16 if half else torch.float32
    seen, mask = tree_visibility(parents, n)
    mask[..., n // 2] = -500.0  # a key every node sees, with a weight of exactly zero
    for tiles in units():
        with on_unit(tiles):
            for draw in range(4):
                gen = torch.Generator().manual_seed(1000 * draw + n * group)
                keys = torch.randn(1, Hkv, n + T, D, generator=gen).to(dtype)
                values = torch.randn(1, Hkv, n + T, D, generator=gen).to(dtype)
                q = torch.randn(1, Hkv * group, T, D, generator=gen).bfloat16()
                lay = paired if pair else (lambda v: v)
                key_lay = packed_keys if pack else (lambda k: k)
                tree = kernels.attention(q, key_lay(keys), lay(values), mask, pair, None, pack)
                for j, slots in enumerate(seen):
                    plain = kernels.attention(q[:, :, j : j + 1].contiguous(), key_lay(keys[:, :, slots].contiguous()),
                                              lay(values[:, :, slots].contiguous()),
                                              mask[:, :, j : j + 1, slots].contiguous(), pair, None, pack)
                    assert torch.equal(tree[:, j], plain[:, 0]), f"draw {draw}, node {j}, tiles {tiles}"


@needs_kernels
@pytest.mark.parametrize("n", [30, 94, 150])
@pytest.mark.parametrize("D", [48, 128])
def test_a_deep_draft_path_equals_plain_decoding_bit_for_bit(n, D, seed=7):
    """A root, a sibling, then a chain of 40 under the root (paths past the sibling's masked slot, as deep as
    the margin that keeps bf16 sums and float32 split where plain decoding splits, csrc SPLIT_MARGIN): every
    chain node over paired values equals plain decoding over its keys packed together, with no mask (a
    decode step's causal call) in the plain runs, on every unit."""
    Hkv, group, chain = 2, 2, 40
    parents = [-1, 0, 0] + list(range(2, 2 + chain - 1))  # node 1 the sibling, 2 .. the chain under the root
    T = len(parents)
    gen = torch.Generator().manual_seed(seed + n)
    keys = torch.randn(1, Hkv, n + T, D, generator=gen).bfloat16()
    values = torch.randn(1, Hkv, n + T, D, generator=gen).bfloat16()
    q = torch.randn(1, Hkv * group, T, D, generator=gen).bfloat16()
    seen, mask = tree_visibility(parents, n)
    for tiles in units():
        with on_unit(tiles):
            tree = kernels.attention(q, keys, paired(values), mask, True)
            for j, slots in enumerate(seen):
                plain = kernels.attention(q[:, :, j : j + 1].contiguous(), keys[:, :, slots].contiguous(),
                                          paired(values[:, :, slots].contiguous()), None, True)
                assert torch.equal(tree[:, j], plain[:, 0]), f"node {j}, tiles {tiles}"


@needs_kernels
@pytest.mark.parametrize("pair,pack", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("T", [1, 9])
def test_rows_of_different_lengths_equal_each_row_alone_bit_for_bit(T, pair, pack):
    """A batch whose rows hold different numbers of cached keys (the longest sets S; a shorter row's slots past
    its own are masked and hold garbage): every row's tree verification equals the same row alone over its own
    slots, bit for bit, on tiles and on AVX-512. The kernel stops each row at its last visible key; stopping
    short of one would change the row's result."""
    Hkv, group, D = 2, 2, 48
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5][:T]
    lengths = [150, 37, 16, 94, 3]  # cached keys per row; slots past them hold garbage
    S = max(lengths) + T
    gen = torch.Generator().manual_seed(T)
    keys = torch.randn(len(lengths), Hkv, S, D, generator=gen).bfloat16()
    values = torch.randn(len(lengths), Hkv, S, D, generator=gen).bfloat16()
    for b, n in enumerate(lengths):
        values[b, :, n + T :] = 1e4  # garbage a leak would show
    q = torch.randn(len(lengths), Hkv * group, T, D, generator=gen).bfloat16()
    lay = paired if pair else (lambda v: v)
    key_lay = packed_keys if pack else (lambda k: k)
    for tiles in units():
        with on_unit(tiles):
            mask = torch.full((len(lengths), 1, T, S), float("-inf"))
            alone = []
            for b, n in enumerate(lengths):
                _, row_mask = tree_visibility(parents, n)
                mask[b, :, :, : n + T] = row_mask[0]
                k, v = keys[b : b + 1, :, : n + T].contiguous(), values[b : b + 1, :, : n + T].contiguous()
                alone.append(kernels.attention(q[b : b + 1], key_lay(k), lay(v), row_mask, pair, None, pack))
                ref = F.scaled_dot_product_attention(q[b : b + 1].float(), k.float().repeat_interleave(group, 1),
                                                     v.float().repeat_interleave(group, 1), attn_mask=row_mask)
                assert (alone[-1].float() - ref.transpose(1, 2).reshape(1, T, -1)).abs().max() <= 0.01
            batch = kernels.attention(q, key_lay(keys), lay(values), mask, pair, None, pack)
            for b in range(len(lengths)):
                assert torch.equal(batch[b], alone[b][0]), f"row {b}, tiles {tiles}"


@needs_kernels
@pytest.mark.parametrize("M,I", [(37, 90), (17, 1100)])  # rows split across threads; rows split in pieces
def test_silu_mul_equals_torch_bit_for_bit(M, I):
    """silu(gate) * up as torch computes it in bf16 (silu rounded first), over large and small gates."""
    gate_up = (bf16(M, 2 * I, seed=31) * 6).contiguous()
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, float("inf"), float("-inf")]).bfloat16()
    out = kernels.silu_mul(gate_up)
    expected = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)  # silu(-inf) * up is NaN in both
    # rows independent of the row count
    torch.testing.assert_close(kernels.silu_mul(gate_up[:3]), out[:3], rtol=0, atol=0, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("equal", [True, False])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("T,D", [(1, 0), (2, 6), (9, 0), (5, 3)])
def test_tree_mask_equals_the_masks_built_from_operators(equal, padded, T, D):
    """The kernels' mask (a bf16 cache on the CPU) equals the one `attention_mask_for` builds from operators (a
    float32 cache of the same lengths) value for value: rows of equal and unequal lengths, trees per row and one
    tree for all, padded new tokens, D draft slots among the cached ones."""
    from tlt.model.kv_cache import KVCache
    from tlt.model.transformer import additive, attention_mask_for, cached_mask

    gen = torch.Generator().manual_seed(61 + T + D)
    B = 4
    lengths = torch.full((B,), 20) if equal else torch.randint(D, 30, (B,), generator=gen)
    tree = torch.rand(B, T, D + T, generator=gen) < 0.5
    valid = torch.rand(B, T, generator=gen) < 0.7 if padded else None
    masks = []
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache(1, B, 2, 16, dtype=dtype)
        cache.reserve(40)
        cache.lengths = lengths.clone()
        masks.append(attention_mask_for(cache, T, tree, None if valid is None else valid.long(), torch.float32))
    assert torch.equal(masks[0], masks[1])
    S = int(lengths.max()) + T
    one_tree = kernels.tree_mask(lengths, tree[:1], valid, S)
    ones = torch.ones(B, T, dtype=torch.bool) if valid is None else valid
    assert torch.equal(one_tree, additive(cached_mask(lengths, tree[:1].expand(B, -1, -1), ones, S), torch.float32))


@needs_kernels
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("M,K,I", [(1, 64, 32), (9, 128, 96), (17, 256, 64), (150, 64, 160)])
def test_linear_with_silu_equals_silu_mul_of_the_gate_up_product_bit_for_bit(tiles, bits, M, K, I):
    """`silu=True` on a gate|up weight (gate rows over up rows) gives silu_mul of the plain product bit for bit,
    with and without bias, on AMX tiles and AVX-512 blocks, 16- and 4-bit weights, one to 150 rows (more than one
    task's chunk of rows on the tiles); rows alone equal rows among others. A weight whose halves do not split
    on a group of 32 columns, or a residual, is refused."""
    if tiles and not kernels.amx():
        pytest.skip("this CPU has no AMX (or the OS does not grant it)")
    x, w = bf16(M, K, seed=51) * 2, bf16(2 * I, K, seed=52)
    bias = torch.randn(2 * I, generator=torch.Generator().manual_seed(53))
    weight, scales = cpu_kernels.pack4(w) if bits == 4 else (cpu_kernels.pack(w), None)
    kernels.set_amx(tiles)
    try:
        for b in (None, bias):
            fused = kernels.linear(x, weight, 2 * I, b, None, scales, silu=True)
            assert fused.shape == (M, I)
            assert torch.equal(fused, kernels.silu_mul(kernels.linear(x, weight, 2 * I, b, None, scales)))
            assert torch.equal(kernels.linear(x[-1:], weight, 2 * I, b, None, scales, silu=True)[0], fused[-1])
        w80 = bf16(80, K, seed=54)  # halves of 40 columns
        odd, odd_scales = cpu_kernels.pack4(w80) if bits == 4 else (cpu_kernels.pack(w80), None)
        with pytest.raises(RuntimeError, match="silu"):
            kernels.linear(x, odd, 80, None, None, odd_scales, silu=True)
        with pytest.raises(RuntimeError, match="silu"):
            kernels.linear(x, weight, 2 * I, None, bf16(M, 2 * I), scales, silu=True)
    finally:
        kernels.set_amx(True)


@needs_kernels
@pytest.mark.parametrize("input_norm,bits", [(True, 16), (False, 16), (False, 4)])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, "paired", "packed"])
def test_layer_step_equals_its_operators_one_by_one(input_norm, bits, masked, cache_dtype):
    """The whole layer in one call gives the bits of the kernels called one at a time (norm, q|k|v, q/k
    norm with RoPE and the cache write, attention, o + residual, norm, gate|up, silu * up, down +
    residual: `layer_step_ops`), on rows of unequal length, and writes the same cache; also on 4-bit
    weights (a drafter's layer), over paired values and over paired values with packed keys."""
    from tlt.model.kv_cache import KVCache
    from tlt.model.rope import rope_tables

    B, T, hidden, H, Hkv, D, inter = 2, 3, 64, 4, 2, 16, 96
    weights = [bf16((H + 2 * Hkv) * D, hidden, seed=41), bf16(hidden, H * D, seed=42),
               bf16(2 * inter, hidden, seed=43), bf16(hidden, inter, seed=44)]
    sizes = [w.shape[0] for w in weights]
    if bits == 4:
        packs, scales = map(list, zip(*(cpu_kernels.pack4(w) for w in weights)))
    else:
        packs, scales = [cpu_kernels.pack(w) for w in weights], [None] * 4
    biases = [torch.randn(sizes[0], generator=torch.Generator().manual_seed(45)), None, None, None]
    qk_norm = torch.rand(H + Hkv, D, generator=torch.Generator().manual_seed(46)) + 0.5
    x = bf16(B, T, hidden, seed=47)
    lengths = torch.tensor([5, 2])
    cos, sin = rope_tables(lengths[:, None] + torch.arange(T), 1.0 / 10000 ** (torch.arange(0, D, 2) / D), 1.0,
                           torch.bfloat16)
    caches = []
    pair, pack = cache_dtype in ("paired", "packed"), cache_dtype == "packed"
    for _ in range(2):
        cache = KVCache(1, B, Hkv, D, dtype=torch.bfloat16 if pair else cache_dtype, paired=pair, packed_keys=pack)
        cache.reserve(8)
        cache.store.normal_(generator=torch.Generator().manual_seed(48))
        cache.lengths = lengths.clone()
        caches.append(cache)
    mask = None
    if masked:
        allowed = torch.rand(B, 1, T, 8, generator=torch.Generator().manual_seed(49)) < 0.7
        allowed[..., 0] = True
        mask = torch.full(allowed.shape, float("-inf")).masked_fill_(allowed, 0.0)
    eps = 1e-6 if input_norm else -1.0
    keys, values, S = caches[0].buffers(0, T)
    out = kernels.layer_step(x, eps, packs, sizes, biases, scales, H, qk_norm, 1e-5, 1e-6, cos, sin, keys, values,
                             caches[0].lengths, S, mask, pair, None, pack)

    keys1, values1, _ = caches[1].buffers(0, T)
    expected = cpu_kernels.layer_step_ops(kernels, x, eps, packs, sizes, biases, scales, H, qk_norm, 1e-5, 1e-6, cos,
                                          sin, keys1, values1, caches[1].lengths, S, mask, pair, None, pack)
    assert torch.equal(out, expected)
    assert torch.equal(caches[0].store, caches[1].store)


@needs_kernels
@pytest.mark.parametrize("pair,pack", [(False, False), (True, False), (True, True)])
def test_layer_step_on_packed_tokens_equals_the_padded_batch_on_its_real_tokens(pair, pack):
    """Rows of 3, 0, 5 and 1 real tokens (of T = 5, right-padded) passed packed with their counts: every real
    token's output and cache slots are the padded batch's bit for bit; the padding's slots hold zeros' keys."""
    from tlt.model.kv_cache import KVCache, natural_keys
    from tlt.model.rope import rope_tables

    B, T, hidden, H, Hkv, D, inter = 4, 5, 64, 4, 2, 16, 96
    weights = [bf16((H + 2 * Hkv) * D, hidden, seed=51), bf16(hidden, H * D, seed=52),
               bf16(2 * inter, hidden, seed=53), bf16(hidden, inter, seed=54)]
    sizes, packs = [w.shape[0] for w in weights], [cpu_kernels.pack(w) for w in weights]
    qk_norm = torch.rand(H + Hkv, D, generator=torch.Generator().manual_seed(55)) + 0.5
    x = bf16(B, T, hidden, seed=56)
    lengths, counts = torch.tensor([6, 2, 9, 4]), torch.tensor([3, 0, 5, 1])
    real = torch.arange(T) < counts[:, None]
    cos, sin = rope_tables(lengths[:, None] + torch.arange(T), 1.0 / 10000 ** (torch.arange(0, D, 2) / D), 1.0,
                           torch.bfloat16)
    C = 16
    keys_seen = torch.arange(C) < lengths[:, None, None] + torch.arange(T)[:, None] + 1  # causal over new tokens
    mask = torch.zeros(B, 1, T, C).masked_fill_(~keys_seen[:, None], float("-inf"))

    def filled_cache():
        cache = KVCache(1, B, Hkv, D, dtype=torch.bfloat16, paired=pair, packed_keys=pack)
        cache.reserve(C)
        cache.store.normal_(generator=torch.Generator().manual_seed(57))
        cache.lengths = lengths.clone()
        return cache

    outs, caches = [], []
    for packed_tokens in (False, True):
        cache = filled_cache()
        keys, values, S = cache.buffers(0, T)
        args = (1e-6, packs, sizes, [None] * 4, [None] * 4, H, qk_norm, 1e-5, 1e-6, cos, sin, keys, values,
                cache.lengths, S, mask[..., :S].contiguous(), pair)
        if packed_tokens:
            outs.append(kernels.layer_step(x[real].contiguous(), *args, counts=counts, packed_keys=pack))
        else:
            outs.append(kernels.layer_step(x, *args, packed_keys=pack)[real])
        caches.append(cache)
    assert outs[1].shape == (int(counts.sum()), hidden)
    assert torch.equal(outs[0], outs[1])
    cache = filled_cache()  # the kernels one at a time, packed too
    keys, values, S = cache.buffers(0, T)
    ops = cpu_kernels.layer_step_ops(kernels, x[real].contiguous(), *args[:11], keys, values, cache.lengths, S,
                                     *args[15:], counts, packed_keys=pack)
    assert torch.equal(ops, outs[1]) and torch.equal(cache.store, caches[1].store)
    lay = natural_keys if pack else (lambda k: k)
    for b in range(B):
        slots = slice(0, int(lengths[b] + counts[b]))
        assert torch.equal(lay(caches[0].keys[0])[b, :, slots], lay(caches[1].keys[0])[b, :, slots])
        if not pair:  # (paired values interleave two slots' dimensions)
            assert torch.equal(caches[0].values[0][b, :, slots], caches[1].values[0][b, :, slots])
            padding = slice(int(lengths[b] + counts[b]), int(lengths[b]) + T)
            assert torch.equal(caches[1].values[0][b, :, padding], torch.zeros_like(caches[1].values[0][b, :, padding]))
    with pytest.raises(RuntimeError, match="counts"):
        kernels.layer_step(x[real].contiguous(), *args, counts=torch.tensor([3, 0, 5, 2]), packed_keys=pack)


@needs_kernels
def test_attention_over_a_bf16_cache_equals_a_float32_cache_of_the_same_values():
    gen = torch.Generator().manual_seed(22)
    keys = torch.randn(2, 2, 40, 48, generator=gen).bfloat16()
    values = torch.randn(2, 2, 40, 48, generator=gen).bfloat16()
    q = torch.randn(2, 4, 3, 48, generator=gen).bfloat16()
    mask = torch.where(torch.rand(2, 1, 3, 40, generator=gen) < 0.8, 0.0, float("-inf"))
    mask[..., 0] = 0.0
    for m in (None, mask):
        assert torch.equal(kernels.attention(q, keys, values, m), kernels.attention(q, keys.float(), values.float(), m))


@needs_kernels
def test_a_built_library_loads_past_a_stale_build_lock(tmp_path):
    """A process killed while `cpp_extension.load` held its build folder's lock leaves the lock file
    behind; the library already built there still loads, without waiting on the lock."""
    import shutil

    name = kernels.__name__
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(kernels.__file__, folder / f"{name}.so")
    (folder / "lock").touch()
    code = (
        "import torch.utils.cpp_extension as c\n"
        f"c._get_build_directory = lambda name, verbose: {str(folder)!r}\n"
        "from tlt.model import cpu_kernels\n"
        "module = cpu_kernels.kernels()\n"
        f"assert module is not None and module.__file__.startswith({str(folder)!r}), module\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=os.getcwd())
