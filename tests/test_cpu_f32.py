"""tlt's float32 CPU kernel (tlt/model/cpu_f32.py): products against PyTorch's on uneven shapes, rows that do not
depend on how many are multiplied, its checks, and where it is chosen."""

import os
import warnings

import pytest
import torch

import tlt.model.packed as packed
from tlt.model import cpu_f32, cpu_kernels


def test_the_kernel_loads_where_the_cpu_runs_it():
    """Where the CPU has AVX2 and FMA and the kernels are not turned off, it builds and loads: a compile error would
    otherwise turn every test below into a skip."""
    flags = cpu_kernels.cpu_flags() or {"avx2", "fma"}  # not Linux: the module's own probe decides
    if os.environ.get(cpu_kernels.ENV, "1") == "0" or not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU has no AVX2 and FMA, or TLT_CPU_KERNELS=0")
    assert cpu_f32.kernels() is not None, cpu_f32._reason


@pytest.fixture(scope="module")
def module():
    m = cpu_f32.kernels()
    if m is None:
        pytest.skip("tlt's float32 CPU kernel does not run here (no AVX2 and FMA, or no compiler)")
    return m


@pytest.mark.parametrize("N,K", [(16, 8), (96, 64), (100, 37), (1, 5), (250, 129)])
def test_products_equal_pytorchs_on_uneven_shapes(module, N, K):
    gen = torch.Generator().manual_seed(N * K)
    w, bias = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    p = cpu_f32.pack(w)
    assert p.shape == (-(-N // 16), K, 16) and torch.equal(p.transpose(1, 2).reshape(-1, K)[:N], w)
    for M in (1, 2, 5, 6, 7, 12, 13, 40):
        x, residual = torch.randn(M, K, generator=gen), torch.randn(M, N, generator=gen)
        tol = dict(rtol=1e-5, atol=1e-5 * K ** 0.5)
        assert torch.allclose(module.linear(x, p, N, None, None), x @ w.T, **tol)
        assert torch.allclose(module.linear(x, p, N, bias, None), x @ w.T + bias, **tol)
        assert torch.allclose(module.linear(x, p, N, bias, residual), x @ w.T + bias + residual, **tol)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(module):
    """Bit for bit, whatever the row count and the register block a row falls in (blocks of 6 rows)."""
    gen = torch.Generator().manual_seed(1)
    w, bias = torch.randn(200, 300, generator=gen), torch.randn(200, generator=gen)
    p = cpu_f32.pack(w)
    x, residual = torch.randn(23, 300, generator=gen), torch.randn(23, 200, generator=gen)
    full = module.linear(x, p, 200, bias, residual)
    for start, stop in ((0, 1), (5, 6), (7, 9), (3, 17), (11, 23)):
        assert torch.equal(module.linear(x[start:stop], p, 200, bias, residual[start:stop]), full[start:stop])
    # rows with a stride (a slice of wider rows) read as contiguous ones, inputs and residual alike
    wide, wide_residual = torch.randn(23, 400, generator=gen), torch.randn(23, 250, generator=gen)
    wide[:, :300], wide_residual[:, :200] = x, residual
    assert torch.equal(module.linear(wide[:, :300], p, 200, bias, wide_residual[:, :200]), full)


def test_many_rows_come_in_tiles_with_the_same_bits(module):
    """Past a tile of rows (48) the weights are streamed again per tile; each row's sums are unchanged."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 70, generator=gen)
    p, x = cpu_f32.pack(w), torch.randn(130, 70, generator=gen)
    full = module.linear(x, p, 40, None, None)
    assert torch.allclose(full, x @ w.T, rtol=1e-5, atol=1e-4)
    for start, stop in ((0, 48), (47, 49), (100, 130), (5, 6)):
        assert torch.equal(module.linear(x[start:stop], p, 40, None, None), full[start:stop])


def test_it_checks_its_inputs(module):
    p = cpu_f32.pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K = 8"):
        module.linear(torch.randn(3, 9), p, 20, None, None)
    with pytest.raises(RuntimeError, match="does not fill"):
        module.linear(torch.randn(3, 8), p, 40, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        module.linear(torch.randn(3, 8), p, 20, torch.randn(19), None)
    with pytest.raises(RuntimeError, match="residual"):
        module.linear(torch.randn(3, 8), p, 20, None, torch.randn(2, 20))
    with pytest.raises(RuntimeError, match="float32"):
        module.linear(torch.randn(3, 8).double(), p, 20, None, None)
    assert module.linear(torch.randn(0, 8), p, 20, None, None).shape == (0, 20)


@pytest.mark.parametrize("N,K", [(16, 128), (40, 256), (100, 96), (33, 37), (250, 640), (24, 192), (20, 50)])
def test_4bit_products_are_products_by_the_unpacked_weight(module, N, K):
    """pack4 rounds each column and k-group to 16 levels (k-groups of 128, 64 or 32, else all of K); the kernel's
    product by the codes is the product by the weight they stand for (within float32 rounding: scale and low
    value are taken out of each k-group's sum), at every row count, with bias and residual, and a row's result
    does not depend on the rows beside it."""
    gen = torch.Generator().manual_seed(N + K)
    w, bias = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    codes, scales = cpu_f32.pack4(w)
    kgroup = next((g for g in cpu_kernels.QGROUPS if K % g == 0), K)
    assert codes.shape == (-(-N // 16), K, 8) and codes.dtype == torch.uint8
    assert scales.shape == (-(-N // 16), K // kgroup, 2, 16)
    rounded = cpu_f32.unpack4(codes, scales, N)
    # each value within half a level of the weight: a level is (max - min) / 15 of its column's k-group
    spread = w.view(N, K // kgroup, kgroup).aminmax(dim=-1)
    level = ((spread.max - spread.min) / 15).repeat_interleave(kgroup, dim=1)
    assert ((rounded - w).abs() <= level / 2 + 1e-5).all()
    assert len(torch.unique(rounded[0, :kgroup])) <= 16
    x, residual = torch.randn(130, K, generator=gen), torch.randn(130, N, generator=gen)
    full = module.linear(x, codes, N, bias, residual, scales)
    exact = (x.double() @ rounded.double().T + bias.double() + residual.double()).float()
    assert torch.allclose(full, exact, rtol=1e-5, atol=1e-5 * K ** 0.5)
    # blocks of 2 rows and a last one of 1; tiles of 48 rows
    for start, stop in ((0, 1), (3, 5), (1, 4), (0, 4), (6, 13), (20, 40), (7, 8), (47, 49), (100, 130)):
        assert torch.equal(module.linear(x[start:stop], codes, N, bias, residual[start:stop], scales), full[start:stop])
    # rows with a stride (a slice of wider rows) read as contiguous ones, inputs and residual alike
    wide, wide_residual = torch.randn(130, K + 9, generator=gen), torch.randn(130, N + 5, generator=gen)
    wide[:, :K], wide_residual[:, :N] = x, residual
    assert torch.equal(module.linear(wide[:, :K], codes, N, bias, wide_residual[:, :N], scales), full)


def test_4bit_weights_check_their_scales(module):
    codes, scales = cpu_f32.pack4(torch.randn(20, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="4-bit codes"):
        module.linear(x, cpu_f32.pack(torch.randn(20, 64)), 20, None, None, scales)
    with pytest.raises(RuntimeError, match="float32, contiguous"):
        module.linear(x, codes, 20, None, None)  # codes without their scales
    with pytest.raises(RuntimeError, match="scales"):
        module.linear(x, codes, 20, None, None, scales[:, :, :1].contiguous())


@pytest.mark.parametrize("flags,chosen", [({"avx2", "fma"}, True), ({"avx2", "fma", "avx512f"}, False),
                                          ({"avx"}, False), (None, False)])
def test_it_is_preferred_on_avx2_cpus_without_avx512(monkeypatch, flags, chosen):
    monkeypatch.setattr(cpu_f32.cpu_kernels, "cpu_flags", lambda: flags)
    assert cpu_f32.preferred() == chosen


@pytest.mark.parametrize("onednn", [True, False])
def test_packed_linear_takes_it_for_large_float32_weights_only(module, monkeypatch, onednn):
    """Whether or not the PyTorch build has oneDNN (the kernel needs none)."""
    monkeypatch.setattr(packed, "ONEDNN", onednn and packed.ONEDNN)
    monkeypatch.setattr(packed, "F32_KERNEL", True)
    large = torch.randn(packed.PACK_MIN_BYTES // 4 // 64 + 16, 64)
    assert packed.PackedLinear(large).f32_kernel is not None
    assert packed.PackedLinear(torch.randn(32, 64)).f32_kernel is None  # small: MKL's column-major layout
    assert packed.PackedLinear(large.bfloat16()).f32_kernel is None
    monkeypatch.setattr(packed, "F32_KERNEL", False)
    assert packed.PackedLinear(large).f32_kernel is None and packed.PackedLinear(large).packed == packed.ONEDNN


def test_a_drafters_4bit_weights_take_it(module, monkeypatch):
    """bits=4 (Drafter.set_weight_bits) packs a large float32 weight as 4-bit codes: an eighth of the bytes; small
    weights keep their float32 values."""
    monkeypatch.setattr(packed, "F32_KERNEL", True)
    large = torch.randn(packed.PACK_MIN_BYTES // 4 // 64 + 16, 64)
    four = packed.PackedLinear(large, bits=4)
    assert four.on_kernel and four.weight.dtype == torch.uint8
    assert four.weight.numel() * 8 == large.numel() * large.element_size()  # bytes
    x = torch.randn(3, 64)
    rounded = cpu_f32.unpack4(four.weight, four.scales, large.shape[0])
    assert torch.allclose(four(x), x @ rounded.T, rtol=1e-5, atol=1e-4)
    assert packed.PackedLinear(torch.randn(32, 64), bits=4).scales is None


def test_without_the_kernel_a_warning_names_the_reason_once(monkeypatch):
    monkeypatch.setenv("TLT_CPU_KERNELS", "0")
    for name, value in (("_module", None), ("_reason", None), ("_warned", False)):
        monkeypatch.setattr(cpu_f32, name, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_f32.kernels() is None and cpu_f32.kernels() is None
    messages = [str(w.message) for w in caught if "float32 CPU kernel" in str(w.message)]
    assert len(messages) == 1 and "TLT_CPU_KERNELS=0" in messages[0] and "oneDNN" in messages[0]


@pytest.mark.parametrize("D", [8, 48, 61])
def test_rms_norm_equals_pytorchs_per_row(module, D):
    """Over the last dimension, with no weight, one weight, or one per middle index (q/k heads); on a slice with
    strided rows too; a row's result does not depend on the rows beside it."""
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(3, 5, D, generator=gen) * 3
    one, per_head = torch.randn(D, generator=gen), torch.randn(5, D, generator=gen)
    ref = torch.nn.functional.rms_norm(x, (D,), None, 1e-6)
    assert torch.allclose(module.rms_norm(x, None, 1e-6), ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(module.rms_norm(x, one, 1e-6), ref * one, rtol=1e-5, atol=1e-6)
    assert torch.allclose(module.rms_norm(x, per_head, 1e-6), ref * per_head, rtol=1e-5, atol=1e-6)
    wide = torch.randn(3, 7, D, generator=gen)
    wide[:, :5] = x
    assert torch.equal(module.rms_norm(wide[:, :5], per_head, 1e-6), module.rms_norm(x, per_head, 1e-6))
    assert torch.equal(module.rms_norm(x[1:2, 2:4].contiguous(), None, 1e-6), module.rms_norm(x, None, 1e-6)[1:2, 2:4])
    with pytest.raises(RuntimeError, match="weight"):
        module.rms_norm(x, torch.randn(D + 1), 1e-6)


def _reference_attention(q, keys, values, S, mask):
    """q [B, T, H, D] over the first S slots by PyTorch's attention -> [B, T, H D]."""
    B, T, H, D = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys[:, :, :S], values[:, :, :S], attn_mask=mask, is_causal=mask is None and T > 1,
        enable_gqa=True)
    return out.transpose(1, 2).reshape(B, T, H * D)


@pytest.mark.parametrize("D,lengths", [(12, (7, 4)), (48, (7, 4)), (64, (7, 4)), (48, (150, 69))])
def test_attention_sees_only_its_keys_and_equals_pytorchs(module, D, lengths):
    """Queries of a 4-node tree after rows of 7 and 4 cached tokens (4 query heads over 2 kv heads) give PyTorch's
    attention within float32 rounding; each query's result is bit for bit what a query over only the keys it sees,
    in consecutive slots and without a mask, gets (a tree node's query equals plain decoding's at its place), whatever
    the hidden slots hold (NaN included); without a mask the new tokens are causal over the last T slots."""
    gen = torch.Generator().manual_seed(D)
    B, T, H, Hkv = 2, 4, 4, 2
    lengths = torch.tensor(lengths)
    C = int(lengths.max()) + T + 5
    S = int(lengths.max()) + T
    keys, values = torch.randn(B, Hkv, C, D, generator=gen), torch.randn(B, Hkv, C, D, generator=gen)
    q = torch.randn(B, T, H, D, generator=gen)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    visible = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        n = int(lengths[b])
        visible[b, :, :n] = True
        visible[b, :, n : n + T] = tree
    mask = torch.zeros(B, 1, T, S).masked_fill(~visible[:, None], float("-inf"))
    out = module.attention(q, keys, values, S, mask)
    assert torch.allclose(out, _reference_attention(q, keys, values, S, mask), atol=1e-5)
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    blind = ~visible.any(1)  # [B, S]: slots no query of the row sees (the shorter row's)
    assert blind.any()
    poisoned_keys.permute(0, 2, 1, 3)[:, :S][blind] = float("nan")
    poisoned_values.permute(0, 2, 1, 3)[:, :S][blind] = float("nan")
    assert torch.equal(module.attention(q, poisoned_keys, poisoned_values, S, mask), out)
    middle = mask.clone()
    middle[0, :, :, 2] = float("-inf")  # a slot between visible ones, hidden from every query of row 0
    poisoned_keys[0, :, 2] = poisoned_values[0, :, 2] = float("nan")
    assert torch.equal(module.attention(q, poisoned_keys, poisoned_values, S, middle),
                       module.attention(q, keys, values, S, middle))
    for b in range(B):
        for t in range(T):
            seen = visible[b, t].nonzero().flatten()
            alone = module.attention(q[b : b + 1, t : t + 1].contiguous(), keys[b : b + 1, :, seen].contiguous(),
                                     values[b : b + 1, :, seen].contiguous(), len(seen), None)
            assert torch.equal(alone[0, 0], out[b, t])
    assert torch.allclose(module.attention(q, keys, values, S, None), _causal_tail(q, keys, values, S), atol=1e-5)


def _causal_tail(q, keys, values, S):
    """q's T new tokens seeing every slot before the last T and the new ones up to themselves."""
    B, T = q.shape[:2]
    allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    mask = torch.zeros(T, S).masked_fill(~allowed, float("-inf")).expand(B, 1, T, S)
    return _reference_attention(q, keys, values, S, mask)


def test_attention_computes_only_the_counted_tokens(module):
    """With counts, row b's tokens past counts[b] come back as zeros and the others as without counts."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 16, generator=gen)
    keys, values = torch.randn(2, 2, 8, 16, generator=gen), torch.randn(2, 2, 8, 16, generator=gen)
    mask = torch.zeros(2, 1, 3, 8)
    full = module.attention(q, keys, values, 8, mask)
    counted = module.attention(q, keys, values, 8, mask, torch.tensor([3, 1]))
    assert torch.equal(counted[0], full[0]) and torch.equal(counted[1, :1], full[1, :1])
    assert not counted[1, 1:].any()
    with pytest.raises(RuntimeError, match="mask must be"):
        module.attention(q, keys, values, 8, torch.zeros(2, 1, 3, 7))


@pytest.mark.parametrize("norm", [False, True])
def test_rope_write_equals_the_operators(module, norm):
    """The per-head norm (q_norm's weights, then k_norm's), RoPE and the cache write of a stacked q|k|v: q comes back
    as the operators compute it, k and v land at each row's next slots, nothing else in the cache changes."""
    from tlt.model.rope import apply_rope

    gen = torch.Generator().manual_seed(2)
    B, T, H, Hkv, D = 2, 3, 4, 2, 12
    qkv = torch.randn(B, T, H + 2 * Hkv, D, generator=gen)
    weight = torch.randn(H + Hkv, D, generator=gen) if norm else None
    cos, sin = torch.randn(B, T, D, generator=gen), torch.randn(B, T, D, generator=gen)
    keys, values = torch.randn(B, Hkv, 10, D, generator=gen), torch.randn(B, Hkv, 10, D, generator=gen)
    before_k, before_v = keys.clone(), values.clone()
    slots = torch.tensor([5, 2])
    q = module.rope_write(qkv, H, weight, 1e-6, cos, sin, keys, values, slots)
    qk = qkv[:, :, : H + Hkv]
    if norm:
        qk = torch.nn.functional.rms_norm(qk, (D,), None, 1e-6) * weight
    qk = apply_rope(qk, cos[:, :, None], sin[:, :, None])
    assert q.shape == (B, T, H, D) and torch.allclose(q, qk[:, :, :H], atol=1e-5)
    for b in range(B):
        s = int(slots[b])
        assert torch.allclose(keys[b, :, s : s + T], qk[b, :, H:].transpose(0, 1), atol=1e-5)
        assert torch.equal(values[b, :, s : s + T], qkv[b, :, H + Hkv :].transpose(0, 1))
        untouched = torch.ones(10, dtype=torch.bool)
        untouched[s : s + T] = False
        assert torch.equal(keys[b, :, untouched], before_k[b, :, untouched])
        assert torch.equal(values[b, :, untouched], before_v[b, :, untouched])
    with pytest.raises(RuntimeError, match="past the cache buffers"):
        module.rope_write(qkv, H, weight, 1e-6, cos, sin, keys, values, torch.tensor([8, 0]))


def test_silu_mul_equals_the_operators(module):
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 2 * 37, generator=gen) * 8
    expected = torch.nn.functional.silu(gate_up[:, :37]) * gate_up[:, 37:]
    assert torch.allclose(module.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(module.silu_mul(gate_up[2:3]), module.silu_mul(gate_up)[2:3])


@pytest.mark.parametrize("equal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_a_float32_caches_masks_come_from_the_kernel_with_the_operators_values(module, monkeypatch, equal, padded):
    """Where the kernel is loaded, a float32 cache's tree masks are built by its tree_mask (shared with the bf16
    kernels), value for value the mask the operators build: rows of equal and unequal lengths, draft slots among
    the cached ones, padded new tokens, one tree for all rows."""
    from tlt.model.kv_cache import KVCache
    from tlt.model.transformer import additive, attention_mask_for, cached_mask

    gen = torch.Generator().manual_seed(7)
    B, T, D = 3, 4, 2
    lengths = torch.full((B,), 12) if equal else torch.randint(D, 20, (B,), generator=gen)
    tree = torch.rand(B, T, D + T, generator=gen) < 0.5
    valid = torch.rand(B, T, generator=gen) < 0.7 if padded else None
    cache = KVCache(1, B, 2, 16, dtype=torch.float32)
    cache.reserve(30)
    cache.lengths = lengths.clone()
    assert cache.mask_kernels() is module
    calls = []
    tree_mask = module.tree_mask
    monkeypatch.setattr(module, "tree_mask", lambda *args: calls.append(1) or tree_mask(*args), raising=False)
    by_kernel = attention_mask_for(cache, T, tree, None if valid is None else valid.long(), torch.float32)
    monkeypatch.setattr(cpu_f32, "_module", None)
    assert cache.mask_kernels() is None
    by_operators = attention_mask_for(cache, T, tree, None if valid is None else valid.long(), torch.float32)
    assert calls == [1] and torch.equal(by_kernel, by_operators)
    S = int(lengths.max()) + T
    ones = torch.ones(B, T, dtype=torch.bool) if valid is None else valid
    assert torch.equal(tree_mask(lengths, tree[:1], valid, S),
                       additive(cached_mask(lengths, tree[:1].expand(B, -1, -1), ones, S), torch.float32))
