"""The same promises on a CUDA device: greedy speculation (learned, n-gram and history drafts) equals plain
decoding, a drafter attention window keeps the samples, returned log-probs equal
a full forward, tree verification reproduces plain sampling, and a GRPO step (with in-process drafter
training) runs with every model on the GPU. Skipped where torch sees no CUDA device; run on a GPU
machine with scripts/gpu_check.sh."""

import pytest
import torch

import tlt
from tlt.rollout.sampling import warp_logprobs
from tlt.speculative import Drafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STRATEGIES = ["chain-d4", "tree-d4-k4-v16", "ngram-d4", "suffix-d8-v16", "hybrid-d3-k2-v8"]


@pytest.fixture(scope="module")
def target():
    model = tlt.load_model("default", device="cuda").eval()
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # else every test here runs on the CPU
    return model


def tokens_of(outputs):
    return [c.token_ids for o in outputs for c in o.outputs]


def prompts_for(count: int):
    from tlt.tasks import ArithmeticTask
    from tlt.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    return [tokenizer.encode(p.prompt) for p in ArithmeticTask().sample(count, seed=0, split="eval")]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_speculation_equals_plain_on_cuda(target, strategy):
    drafter = Drafter.load("default", target)
    prompts = prompts_for(6)
    params = tlt.SamplingParams(n=2, temperature=0, max_tokens=96)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="on", strategy=strategy, drafter=drafter))
    assert tokens_of(spec.generate(prompts, params)) == tokens_of(plain)
    assert spec.stats()["acceptance_length"] > 1.0


@pytest.mark.parametrize("strategy", ["tree-d4-k4-v16", "ngram-d4", "hybrid-d3-k2-v8"])
def test_tree_verification_reproduces_plain_sampling_on_cuda(target, strategy):
    drafter = Drafter.load("default", target)
    prompts = prompts_for(4)
    params = tlt.SamplingParams(n=4, temperature=1.0, max_tokens=96, seed=3)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="on", strategy=strategy, drafter=drafter))
    assert tokens_of(spec.generate(prompts, params)) == tokens_of(plain)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_drafter_window_stays_lossless_on_cuda(target, temperature):
    """A window of 8 keys trims the drafter's cache (KVCache.compact on the GPU) many times in 96 tokens;
    the samples stay plain decoding's."""
    drafter = Drafter.load("default", target)
    prompts = prompts_for(4)
    params = tlt.SamplingParams(n=2, temperature=temperature, max_tokens=96, seed=5)
    plain = tlt.RolloutEngine(target).generate(prompts, params)
    spec = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="on", strategy="tree-d4-k2-v8",
                                                            drafter=drafter, drafter_window=8))
    assert tokens_of(spec.generate(prompts, params)) == tokens_of(plain)
    assert spec.stats()["acceptance_length"] > 1.0


def test_logprobs_equal_a_full_forward_on_cuda(target):
    drafter = Drafter.load("default", target)
    prompt = prompts_for(1)[0]
    params = tlt.SamplingParams(n=3, temperature=0.9, top_p=0.95, top_k=20, max_tokens=64, seed=1)
    engine = tlt.RolloutEngine(target, config=tlt.EngineConfig(speculative="on", strategy="chain-d4", drafter=drafter))
    for c in engine.generate([prompt], params)[0].outputs:
        with torch.no_grad():
            full = target(torch.tensor([prompt + c.token_ids], device="cuda"))
        logits = full.logits[0, len(prompt) - 1 : -1]
        n = len(c.token_ids)
        warped = warp_logprobs(logits, torch.full((n,), 0.9, device="cuda"), torch.full((n,), 20, device="cuda"),
                               torch.full((n,), 0.95, device="cuda"))
        ref = warped.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0].cpu()
        assert (torch.tensor(c.logprobs) - ref).abs().max() <= 1e-4


def test_grpo_step_with_drafter_training_on_cuda(tmp_path):
    from tlt.rl import GRPOTrainer, TrainConfig
    from tlt.rl.config import EvalConfig, LogConfig
    from tlt.spot import SpotConfig

    c = TrainConfig(device="cuda", workers=1, prompts_per_step=4, group_size=4, max_response_tokens=64, steps=2,
                    eval=EvalConfig(every=0), save_every=0, speculative="adaptive", log=LogConfig(progress=False),
                    drafter=SpotConfig(model="default", train="every", min_pairs=1, local_steps=2))
    trainer = GRPOTrainer(c, tmp_path, log=lambda *_: None)
    try:
        assert trainer.policy.device.type == trainer.engine.model.device.type == "cuda"
        rows = [trainer.train_step() for _ in range(2)]
        assert all(r["ratio_first_max_dev"] < 1e-3 for r in rows)
        assert rows[-1]["drafter_phase_steps"] == 2 and rows[-1]["drafter_version"] == 2
    finally:
        trainer.close()


def test_bf16_decoding_on_cuda_never_plans_cudnn_attention():
    """A bf16 decode step attends over one more key each step; cuDNN's attention would plan anew for each
    shape (5 ms of CPU a call), so tlt's attention keeps it out: a bf16 rollout runs no cuDNN attention."""
    from torch.profiler import ProfilerActivity, profile

    model = tlt.load_model("default", dtype=torch.bfloat16, device="cuda").eval()
    prompts = prompts_for(3)
    params = tlt.SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = tlt.RolloutEngine(model).generate(prompts, params)
    names = {event.key for event in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not any("cudnn_attention" in name for name in names)
    assert all(len(ids) == 32 for ids in tokens_of(outputs))
