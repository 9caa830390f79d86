"""A drafter on 4-bit weights (`Drafter.set_weight_bits`, `EngineConfig.drafter_bits`): it drafts nearly
as well, the samples stay plain decoding's, the rounded weights follow the parameters, and training reads
the parameters themselves."""

import pytest
import torch

import tlt
from tlt.errors import ConfigError
from tlt.model import cpu_kernels
from tlt.speculative import Drafter

import tlt.model.packed as packed
from tlt.model import cpu_f32


@pytest.fixture(params=["bf16 kernels", "float32 kernel"])
def default_model(request, monkeypatch):
    """The default model on one of tlt's CPU kernels that take 4-bit weights: bf16 (AVX-512 CPUs), or float32 with
    every weight on the AVX2 float32 kernel (as a large model's on CPUs without AVX-512)."""
    from tlt.model.checkpoint import resolve_model_path
    from tlt.tasks import get_task
    from tlt.tokenizer import load_tokenizer

    if request.param == "bf16 kernels":
        if cpu_kernels.kernels() is None:
            pytest.skip("tlt's bf16 CPU kernels do not run on this machine")
        dtype = torch.bfloat16
    else:
        if cpu_f32.kernels() is None:
            pytest.skip("tlt's float32 CPU kernel does not run on this machine")
        monkeypatch.setattr(packed, "F32_KERNEL", True)
        monkeypatch.setattr(packed, "PACK_MIN_BYTES", 0)
        dtype = torch.float32
    model = tlt.load_model("default", dtype=dtype).eval()
    tokenizer = load_tokenizer(resolve_model_path("default"))
    return model, [tokenizer.encode(p.prompt) for p in get_task("arithmetic").sample(3, seed=0, split="eval")]


def generate(model, prompts, params, drafter=None, bits=16, strategy="tree-d4-k2-v8"):
    config = tlt.EngineConfig(speculative="on", strategy=strategy, drafter=drafter, drafter_bits=bits) if drafter \
        else tlt.EngineConfig()
    engine = tlt.RolloutEngine(model, config=config)
    outputs = engine.generate(prompts, params)
    return [c.token_ids for o in outputs for c in o.outputs], engine.stats().get("acceptance_length")


def test_a_four_bit_drafter_drafts_nearly_as_well_and_the_samples_stay_plain_decodings(default_model):
    """The default model and drafter on each kernel: greedy and T = 1 sampling (target-only tree verification)
    give plain decoding's tokens with the 4-bit drafter, which accepts about as much as the 16-bit one."""
    model, prompts = default_model
    for temperature in (0.0, 1.0):
        params = tlt.SamplingParams(n=2, temperature=temperature, max_tokens=64, seed=5, ignore_eos=True)
        plain, _ = generate(model, prompts, params)
        full, accept16 = generate(model, prompts, params, Drafter.load("default", model), 16)
        four, accept4 = generate(model, prompts, params, Drafter.load("default", model), 4)
        assert full == plain and four == plain
        assert accept4 >= 0.85 * accept16 and accept4 > 1.5


def test_four_bit_weights_follow_the_parameters_and_training_reads_the_parameters(default_model):
    model, _ = default_model
    drafter = Drafter.load("default", model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.config.vocab_size, (1, 6), generator=gen)
    features = torch.randn(1, 6, model.config.hidden_size, generator=gen).to(model.dtype)
    positions = torch.arange(6)[None]

    def forward(d, grad=False):
        with torch.set_grad_enabled(grad):
            return d(tokens, features, positions)[0].detach().float()

    full = forward(drafter)
    trained_view = forward(drafter, grad=True)
    drafter.set_weight_bits(4)
    rounded = forward(drafter)
    assert not torch.equal(rounded, full)  # the rounding does something
    assert torch.nn.functional.cosine_similarity(rounded.flatten(), full.flatten(), dim=0) > 0.98
    assert torch.equal(forward(drafter, grad=True), trained_view)  # training: the parameters as they are
    with torch.no_grad():  # an optimizer step, as it writes
        drafter.fc.weight.mul_(1.5)
        drafter.layer.mlp.down_proj.weight.mul_(0.5)
    fresh = Drafter.load("default", model)
    fresh.load_state_dict(drafter.state_dict())
    fresh.set_weight_bits(4)
    after = forward(drafter)
    assert not torch.equal(after, rounded) and torch.equal(after, forward(fresh))
    drafter.set_weight_bits(16)
    fresh.set_weight_bits(16)
    assert torch.equal(forward(drafter), forward(fresh))


def test_drafter_bits_must_be_4_or_16():
    for bad in (8, 4.0, True):
        with pytest.raises(ConfigError, match="drafter_bits"):
            tlt.EngineConfig(drafter_bits=bad)
    with pytest.raises(ValueError, match="bits"):
        Drafter.from_target(tlt.load_model("default"), seed=0).set_weight_bits(3)
