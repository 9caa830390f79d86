"""A drafter on 4-bit weights (`Drafter.set_weight_bits`, `EngineConfig.drafter_bits`): it drafts nearly
as well, the samples stay plain decoding's, the rounded weights follow the parameters, and training reads
the parameters themselves."""

import pytest
import torch

import tlt
from tlt.errors import ConfigError
from tlt.model import cpu_kernels
from tlt.speculative import Drafter

needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None,
                                   reason="tlt's bf16 CPU kernels do not run on this machine")


@pytest.fixture(scope="module")
def default_bf16():
    from tlt.model.checkpoint import resolve_model_path
    from tlt.tasks import get_task
    from tlt.tokenizer import load_tokenizer

    model = tlt.load_model("default", dtype=torch.bfloat16).eval()
    tokenizer = load_tokenizer(resolve_model_path("default"))
    return model, [tokenizer.encode(p.prompt) for p in get_task("arithmetic").sample(3, seed=0, split="eval")]


def generate(model, prompts, params, drafter=None, bits=16, strategy="tree-d4-k2-v8"):
    config = tlt.EngineConfig(speculative="on", strategy=strategy, drafter=drafter, drafter_bits=bits) if drafter \
        else tlt.EngineConfig()
    engine = tlt.RolloutEngine(model, config=config)
    outputs = engine.generate(prompts, params)
    return [c.token_ids for o in outputs for c in o.outputs], engine.stats().get("acceptance_length")


@needs_kernels
def test_a_four_bit_drafter_drafts_nearly_as_well_and_the_samples_stay_plain_decodings(default_bf16):
    """The default model and drafter in bf16: greedy and T = 1 sampling (target-only tree verification)
    give plain decoding's tokens with the 4-bit drafter, which accepts about as much as the 16-bit one."""
    model, prompts = default_bf16
    for temperature in (0.0, 1.0):
        params = tlt.SamplingParams(n=2, temperature=temperature, max_tokens=64, seed=5, ignore_eos=True)
        plain, _ = generate(model, prompts, params)
        full, accept16 = generate(model, prompts, params, Drafter.load("default", model), 16)
        four, accept4 = generate(model, prompts, params, Drafter.load("default", model), 4)
        assert full == plain and four == plain
        assert accept4 >= 0.85 * accept16 and accept4 > 1.5


@needs_kernels
def test_four_bit_weights_follow_the_parameters_and_training_reads_the_parameters(default_bf16):
    model, _ = default_bf16
    drafter = Drafter.load("default", model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.config.vocab_size, (1, 6), generator=gen)
    features = torch.randn(1, 6, model.config.hidden_size, generator=gen).bfloat16()
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
