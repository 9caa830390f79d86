"""The fused inference step of a decoder layer (tlt/model/fused.py) against the reference layer, on each
kind of prepared weight (tlt/model/packed.py), and its prepared weights against every way the
parameters can change."""

import pytest
import torch

import tlt.model.packed as packed
from tlt.model import cpu_f32, cpu_kernels
from tlt.model.fused import fused_layer_step, uses_fused_step
from tlt.model.transformer import attention_mask_for

# How the products of the tiny test models run: as the default model's (column-major MKL weights in
# float32, tlt's bf16 kernel in bf16), on weights prepacked for oneDNN (forced: the tiny weights are
# below PACK_MIN_BYTES; bf16 without the kernel), on tlt's float32 kernel (forced, as a large float32 model's on
# a CPU without AVX-512), and as on a CPU build without oneDNN or the kernels.
PACKINGS = {"column-major": {}, "packed": {"PACK_MIN_BYTES": 0, "KERNELS": False, "F32_KERNEL": False},
            "float32 kernel": {"PACK_MIN_BYTES": 0, "F32_KERNEL": True},
            "no oneDNN": {"ONEDNN": False, "PACK_MIN_BYTES": 0, "KERNELS": False}}


@pytest.fixture(params=PACKINGS)
def packing(request, monkeypatch):
    if request.param in ("packed", "float32 kernel") and not packed.ONEDNN:
        pytest.skip("this PyTorch build has no oneDNN")
    if request.param == "float32 kernel" and cpu_f32.kernels() is None:
        pytest.skip("tlt's float32 CPU kernel does not run here (no AVX2 and FMA, or no compiler)")
    for name, value in PACKINGS[request.param].items():
        monkeypatch.setattr(packed, name, value)
    return request.param

VARIANTS = {
    "qwen3 (q/k norm)": dict(qk_norm=True),
    "qwen2 (q/k/v bias)": dict(architecture="Qwen2ForCausalLM", qk_norm=False, qkv_bias=True),
    "llama (o and mlp bias)": dict(architecture="LlamaForCausalLM", qk_norm=False, o_bias=True, mlp_bias=True),
    "llama (one kv head per query head)": dict(architecture="LlamaForCausalLM", qk_norm=False, num_key_value_heads=4),
}


def reference(layer, *args):
    """The reference layer's result without gradients (where the model itself would take the fused step)."""
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr("tlt.model.transformer.uses_fused_step", lambda x: False)
        return layer(*args)


def fused(layer, *args):
    with torch.no_grad():
        return fused_layer_step(layer.fused_weights(), *args)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_step_equals_reference_layer(tiny_model, variant, packing):
    model = tiny_model(seed=2, **VARIANTS[variant])
    layer = model.model.layers[1]
    qkv = layer.fused_weights().qkv
    assert qkv.packed == (packing in ("packed", "float32 kernel"))
    assert (qkv.f32_kernel is not None) == (packing == "float32 kernel")
    H = model.config.hidden_size
    torch.manual_seed(0)
    # Training forward: causal over 7 tokens, no cache.
    x = torch.randn(2, 7, H)
    cos, sin = model.rope(torch.arange(7).expand(2, 7), model.inv_freq, 1.0, torch.float32)
    assert torch.allclose(fused(layer, x, cos, sin, None, None, 1), reference(layer, x, cos, sin, None, None, 1),
                          atol=1e-5)
    # Cached forward of a 4-node tree after rows of unequal lengths (9 and 5 cached tokens).
    for step in (reference, fused):
        cache = model.new_cache(2)
        lengths = torch.tensor([9, 5])
        prompt = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(4))
        pos = torch.arange(9).expand(2, 9)
        p_cos, p_sin = model.rope(pos, model.inv_freq, 1.0, torch.float32)
        valid = torch.arange(9)[None] < lengths[:, None]
        mask = attention_mask_for(cache, 9, None, valid.long(), torch.float32)
        step(layer, prompt, p_cos, p_sin, mask, cache, 1)
        cache.advance(lengths)
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        new = torch.randn(2, 4, H, generator=torch.Generator().manual_seed(5))
        t_pos = lengths[:, None] + torch.tensor([0, 1, 1, 2])
        t_cos, t_sin = model.rope(t_pos, model.inv_freq, 1.0, torch.float32)
        out = step(layer, new, t_cos, t_sin, attention_mask_for(cache, 4, tree, None, torch.float32), cache, 1)
        if step is reference:
            expected = out
    assert torch.allclose(out, expected, atol=1e-5)


def test_fused_drafter_layer_without_input_norm(tiny_model, packing):
    from tlt.speculative import Drafter

    model = tiny_model(seed=1)
    drafter = Drafter.from_target(model, seed=3)
    x = torch.randn(1, 6, model.config.hidden_size)
    cos, sin = model.rope(torch.arange(6)[None], model.inv_freq, 1.0, torch.float32)
    assert isinstance(drafter.layer.input_layernorm, torch.nn.Identity)
    assert torch.allclose(fused(drafter.layer, x, cos, sin, None, None, 0),
                          reference(drafter.layer, x, cos, sin, None, None, 0), atol=1e-5)


def test_model_runs_the_fused_step_without_gradients_only(tiny_model):
    model = tiny_model(seed=4)
    ids = torch.randint(3, 61, (2, 11))
    with torch.no_grad():
        fused_logits = model(ids).logits
    assert model.model.layers[0]._fused.value is not None
    assert torch.allclose(model(ids).logits.detach(), fused_logits, atol=1e-5)
    assert not uses_fused_step(torch.zeros(1, 1, 8))
    with torch.no_grad():
        assert uses_fused_step(torch.zeros(4, 128, 8))
        assert not uses_fused_step(torch.zeros(4, 129, 8))  # past MAX_ROWS tokens the reference layer is faster
        big_bf16 = torch.zeros(4, 129, 8, dtype=torch.bfloat16)  # except in bf16 on tlt's kernels
        assert uses_fused_step(big_bf16) == (cpu_kernels.kernels() is not None)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(packed, "KERNELS", False)
            assert not uses_fused_step(big_bf16)
        assert uses_fused_step(torch.zeros(1, 1, 8, dtype=torch.bfloat16))  # on the CPU
        assert not uses_fused_step(torch.zeros(1, 1, 8, dtype=torch.float16))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16-autocast trainer's recomputed log-probs
            assert not uses_fused_step(torch.zeros(1, 1, 8))
            autocast_logits = model(ids).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(ids).logits.detach(), autocast_logits)  # the update's forward, bit for bit
    # bf16 on the CPU runs the fused step on packed weights, within bf16 rounding of the reference layer.
    half = tiny_model(seed=4).bfloat16()
    with torch.no_grad():
        fused_half = half(ids).logits.float()
    assert half.model.layers[0]._fused.value is not None
    reference_half = half(ids).logits.detach().float()
    scale = reference_half.abs().max()
    assert (fused_half - reference_half).abs().max() <= 0.03 * scale
    assert (fused_half.argmax(-1) == reference_half.argmax(-1)).float().mean() >= 0.9


def test_a_verification_past_max_rows_keeps_the_float32_kernels_bits(tiny_model, monkeypatch):
    """On tlt's float32 kernel (forced on the tiny weights) a cached forward of more than MAX_ROWS tokens (65 rows of
    8, as a wide batch's verification) still runs the kernel's layer step: each row's logits equal, bit for bit,
    those of the same row forwarded alone, so speculative decoding at any batch keeps plain decoding's bits."""
    from tlt.model.fused import MAX_ROWS

    if cpu_f32.kernels() is None:
        pytest.skip("tlt's float32 CPU kernel does not run here")
    monkeypatch.setattr(packed, "PACK_MIN_BYTES", 0)
    monkeypatch.setattr(packed, "F32_KERNEL", True)
    model = tiny_model(seed=9)
    gen = torch.Generator().manual_seed(1)
    B, T = 65, 8
    assert B * T > MAX_ROWS
    prompt, new = torch.randint(3, 61, (B, 6), generator=gen), torch.randint(3, 61, (B, T), generator=gen)
    outs = []
    with torch.inference_mode():
        for rows in (slice(0, B), slice(3, 4)):
            cache = model.new_cache(rows.stop - rows.start)
            model(prompt[rows], cache=cache)
            outs.append(model(new[rows], cache=cache).logits)
    assert torch.equal(outs[0][3], outs[1][0])


def test_the_bf16_packing_probe_agrees_with_torchs_own_check():
    """ONEDNN_BF16 (a reorder and product tried at import) says what PyTorch says of this CPU's oneDNN bf16: an
    AVX-512 CPU packs bf16 weights, an AVX2-only one cannot (and its bf16 weights stay plain)."""
    assert packed.ONEDNN_BF16 == (packed.ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_bf16_fused_step_within_bf16_rounding_of_float32(tiny_model, packing):
    """bf16 products take packed oneDNN weights wherever oneDNN packs bf16 (whatever their size), plain bf16
    ones otherwise (no oneDNN, or an AVX2-only CPU); either way a cached bf16 forward stays within bf16 rounding
    of float32's, row by row."""
    model = tiny_model(seed=3)
    half = tiny_model(seed=3).bfloat16()
    ids = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        exact = model(ids).logits
        cache = half.new_cache(2)
        prefill = half(ids[:, :8], cache=cache).logits
        rest = half(ids[:, 8:], cache=cache).logits  # 4 new tokens after 8 cached ones
    qkv = half.model.layers[0].fused_weights().qkv
    assert qkv.packed == (qkv.kernels is not None or (packing != "no oneDNN" and packed.ONEDNN_BF16))
    bf16_kernels = packing in ("column-major", "float32 kernel") and cpu_kernels.kernels() is not None
    assert (qkv.kernels is not None) == bf16_kernels and qkv.f32_kernel is None
    # bf16 keys and values are cached in bf16 where the kernels run, in float32 for the operator path
    assert cache.dtype == (torch.bfloat16 if qkv.kernels is not None else torch.float32)
    got = torch.cat([prefill, rest], 1).float()
    assert (got - exact).abs().max() <= 0.03 * exact.abs().max()


def no_grad_logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


def grad_logits(model, ids):
    return model(ids).logits.detach()


def changes():
    """Ways a policy's weights change between rollouts, each applied to a model in place."""

    def optimizer_step(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randint(3, 61, (1, 8))).logits.square().mean().backward()
        opt.step()

    def load_state_dict(model):
        other = {k: v + 0.05 for k, v in model.state_dict().items()}
        model.load_state_dict(other)

    def load_state_dict_assign(model):
        other = {k: (v * 1.1).clone() for k, v in model.state_dict().items()}
        model.load_state_dict(other, assign=True)

    def copy_under_no_grad(model):  # as a weight sync writes the trainer's weights into a rollout copy
        k_proj = model.model.layers[0].self_attn.k_proj
        with torch.no_grad():
            k_proj.weight.copy_(torch.randn_like(k_proj.weight))
            model.model.layers[1].post_attention_layernorm.weight.mul_(1.5)
            model.lm_head.weight.mul_(-1)  # untied here: the LM head's packed weight must follow too

    def cast_round_trip(model):
        model.double()
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.add_(0.1)
        model.float()

    def new_parameter(model):
        w = model.model.layers[0].mlp.down_proj.weight
        model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(w.detach() * -1)

    return [optimizer_step, load_state_dict, load_state_dict_assign, copy_under_no_grad, cast_round_trip, new_parameter]


@pytest.mark.parametrize("change", changes(), ids=lambda f: f.__name__)
def test_fused_weights_follow_parameter_changes(tiny_model, change, packing):
    """The prepared weights (fused, packed, the LM head's) are keyed by each parameter's storage and
    version: after any of these changes the next inference forward must use the new weights, never the
    ones prepared before."""
    model = tiny_model(seed=6, tie_word_embeddings=change.__name__ != "copy_under_no_grad")
    ids = torch.randint(3, 61, (2, 9))
    before = no_grad_logits(model, ids)  # prepares the fused weights
    change(model)
    after = no_grad_logits(model, ids)
    assert not torch.allclose(after, before, atol=1e-3)
    assert torch.allclose(after, grad_logits(model, ids), atol=1e-5)


def test_a_deep_copy_prepares_weights_from_its_own_parameters(tiny_model, packing):
    """A copy made after inference (the engine's model copied for a worker, say) carries the prepared
    weights and the tables they are keyed by; both must refer to the copy's parameters."""
    import copy

    model = tiny_model(seed=7)
    ids = torch.randint(3, 61, (2, 9))
    before = no_grad_logits(model, ids)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.9)
    assert torch.allclose(no_grad_logits(twin, ids), grad_logits(twin, ids), atol=1e-5)
    assert torch.equal(no_grad_logits(model, ids), before)


@pytest.mark.parametrize("dtype,kernels", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                           (torch.bfloat16, True)])
def test_packed_rows_do_not_depend_on_how_many_rows_are_multiplied(dtype, kernels, monkeypatch):
    """In bf16, and in float32 on tlt's float32 kernel, a verification forward's row equals the one-token step's
    bit for bit (the greedy and seeded equality of speculative and plain decoding rest on it), whatever kernel
    oneDNN picks for the row count, the single row's padding included; in float32 oneDNN's kernels for different
    row counts round differently, within float32 rounding. 3-D inputs take the same 2-D path."""
    if not packed.ONEDNN:
        pytest.skip("this PyTorch build has no oneDNN")
    if kernels and (cpu_kernels if dtype == torch.bfloat16 else cpu_f32).kernels() is None:
        pytest.skip(f"tlt's {dtype} CPU kernels do not run here")
    monkeypatch.setattr(packed, "PACK_MIN_BYTES", 0)
    monkeypatch.setattr(packed, "KERNELS", kernels)
    monkeypatch.setattr(packed, "F32_KERNEL", kernels)
    gen = torch.Generator().manual_seed(0)
    linear = packed.PackedLinear(torch.randn(96, 64, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype))
    # an AVX2-only CPU's oneDNN packs no bf16: the weight stays plain and PyTorch's bf16 product must keep rows apart
    assert linear.packed == (kernels or dtype == torch.float32 or packed.ONEDNN_BF16)
    assert (linear.kernels is not None) == (kernels and dtype == torch.bfloat16)
    assert (linear.f32_kernel is not None) == (kernels and dtype == torch.float32)
    x, residual = torch.randn(17, 64, generator=gen).to(dtype), torch.randn(17, 96, generator=gen).to(dtype)
    exact = dtype == torch.bfloat16 or kernels
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    for m in (1, 4, 9, 17):
        assert same(linear(x[:m])[0], linear(x)[0])
        assert same(linear.add(residual[:m], x[:m])[0], linear.add(residual, x)[0])
        if linear.f32_kernel is not None:  # every row, not only the first
            assert same(linear(x[:m]), linear(x)[:m]) and same(linear.add(residual[:m], x[:m]), linear.add(residual, x)[:m])
    assert torch.equal(linear(x[None, :1])[0, 0], linear(x[:1])[0])
    assert linear(x[:1]).shape == (1, 96) and linear.add(residual[:1], x[:1]).shape == (1, 96)


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="tlt's bf16 CPU kernels do not run on this machine")
def test_bf16_and_float32_caches_give_the_same_logits(tiny_model):
    """A bf16 model's cache holds bf16 values in either dtype, so the kernels' forwards over a bf16 and a
    float32 cache agree bit for bit: prefill, one-token steps, a padded tree-masked verification."""
    half = tiny_model(seed=5).bfloat16()
    ids = torch.randint(3, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]]).expand(2, 3, 3)
    logits = {}
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            cache = half.new_cache(2, dtype=dtype)
            out = [half(ids[:, :6], cache=cache).logits, half(ids[:, 6:7], cache=cache).logits]
            cache.rollback(torch.tensor([7, 5]))
            out.append(half(ids[:, 7:10], cache=cache, tree_mask=tree,
                            position_ids=cache.lengths[:, None] + torch.tensor([0, 1, 1])).logits)
            logits[dtype] = torch.cat(out, 1)
    assert torch.equal(logits[torch.bfloat16], logits[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tree", [False, True])
def test_right_padded_rows_run_packed_with_the_padded_forwards_bits(tiny_model, monkeypatch, tree, dtype):
    """A cached forward whose rows carry 4, 1 and 3 real tokens of 4 (right-padded drafts, prompts of
    different lengths) runs its layers on the 8 real tokens only, and every real token's logits, features
    and layer outputs are those of the forward over the padded [3, 4] (packing turned off) bit for bit: on tlt's bf16
    kernels, and on its float32 kernel (forced on the tiny weights, as a large float32 model's on an AVX2 CPU)."""
    import tlt.model.transformer as transformer

    if dtype == torch.bfloat16 and cpu_kernels.kernels() is None:
        pytest.skip("tlt's bf16 CPU kernels do not run on this machine")
    if dtype == torch.float32:
        if cpu_f32.kernels() is None:
            pytest.skip("tlt's float32 CPU kernel does not run here")
        monkeypatch.setattr(packed, "PACK_MIN_BYTES", 0)
        monkeypatch.setattr(packed, "F32_KERNEL", True)
    half = tiny_model(seed=6).to(dtype)
    ids = torch.randint(3, 61, (3, 10), generator=torch.Generator().manual_seed(4))
    real = torch.tensor([[True] * 4, [True, False, False, False], [True, True, True, False]])
    masks = {}
    if tree:
        masks = dict(tree_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]).bool().expand(3, 4, 4),
                     position_ids=torch.tensor([0, 1, 1, 2]).expand(3, 4))
    seen = []
    kernel = half.model.layers[0].fused_weights().step_kernel
    assert kernel is (cpu_kernels.kernels() if dtype == torch.bfloat16 else cpu_f32.kernels())
    layer_step = kernel.layer_step
    monkeypatch.setattr(kernel, "layer_step",
                        lambda x, *args, **kw: seen.append(tuple(x.shape)) or layer_step(x, *args, **kw), raising=False)
    outs = []
    with torch.inference_mode():
        for packs in (True, False):
            if not packs:
                monkeypatch.setattr(transformer.Transformer, "_packed", lambda *args: None)
            cache = half.new_cache(3)
            half(ids[:, :6], cache=cache)
            cache.rollback(torch.tensor([6, 3, 5]))
            extra = dict(masks)
            if tree:
                extra["position_ids"] = cache.lengths[:, None] + masks["position_ids"]
            out = half(ids[:, 6:10], attention_mask=real, cache=cache, output_layers=(0,), **extra)
            outs.append((out.logits[real], out.hidden_states[real], out.layer_states[0][real], cache.lengths.clone()))
    H = half.config.hidden_size  # two layers each: prefill, packed real tokens; prefill, padded rows
    assert seen == [(3, 6, H)] * 2 + [(8, H)] * 2 + [(3, 6, H)] * 2 + [(3, 4, H)] * 2
    for a, b in zip(*outs):
        assert torch.equal(a, b)
