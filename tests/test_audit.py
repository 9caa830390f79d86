"""`tlt audit`: its statistics are calibrated (exact draws pass, sharpened or flattened draws fail), every
exact system passes on a random target with a random drafter, a verifier with a deliberate bias fails,
greedy decoding is checked token for token, and the command line writes its record and exit code."""

import json

import pytest
import torch

from tlt import audit as audit_module
from tlt.audit import audit, kolmogorov_p, position_statistics, verdict
from tlt.cli import main
from tlt.speculative import Drafter

from test_speculative import random_target


def draws(logits: torch.Tensor, power: float, seed: int) -> dict:
    """Tokens drawn from softmax(power * logits) but judged against softmax(logits)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial((logits * power).softmax(-1), 1, generator=gen)[:, 0]
    return position_statistics(logits.log_softmax(-1), tokens, torch.rand(len(tokens), generator=gen, dtype=torch.float64))


def test_statistics_pass_exact_draws_and_catch_sharpened_or_flattened_ones():
    logits = torch.randn(20000, 50, generator=torch.Generator().manual_seed(0)) * 1.5
    exact = verdict([draws(logits, 1.0, 1)], alpha=1e-3)
    assert exact["passed"] and exact["ks_p"] > 1e-3 and abs(exact["score_z"]) < 3.5
    sharp = verdict([draws(logits, 1.15, 2)], alpha=1e-3)
    assert not sharp["passed"] and sharp["score_z"] > 0 and "peaked" in sharp["reason"]
    flat = verdict([draws(logits, 0.85, 3)], alpha=1e-3)
    assert not flat["passed"] and flat["score_z"] < 0 and "flat" in flat["reason"]
    assert kolmogorov_p(0.0, 100) == 1.0 and kolmogorov_p(0.5, 100) < 1e-9
    assert kolmogorov_p(1.36 / 100, 10000) == pytest.approx(0.05, abs=0.005)  # the textbook 5% point


def test_a_token_outside_the_warped_support_fails():
    lp = torch.tensor([[0.0, float("-inf")]]).expand(2000, 2).log_softmax(-1)
    stats = position_statistics(lp, torch.tensor([0] * 1999 + [1]), torch.rand(2000, dtype=torch.float64))
    result = verdict([stats], alpha=1e-3)
    assert not result["passed"] and result["outside_support"] == 1 and "outside the warped support" in result["reason"]


SYSTEMS = ["off", "chain-d3", "tree-d3-k3-v8", "ngram-d3", "adaptive"]


def prompts():
    return [torch.randint(3, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 5, 8, 4)]


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=5)])
def test_every_exact_system_passes(warp):
    target = random_target(seed=5)
    result = audit(target, None, prompts(), SYSTEMS, Drafter.from_target(target, seed=3).eval(), samples=48,
                   max_tokens=24, seed=1, **warp)
    for name, r in result["systems"].items():
        assert r["passed"], (name, r)
        assert r["tokens"] > 2000
    assert result["passed"]


def test_bfloat16_engines_pass_too():
    """Weights in bf16, as GPU rollouts run them: sampling is exact with respect to the bf16 target's own
    distribution. Greedy decoding agrees token for token except where the target's two best logits lie
    within bf16 rounding of each other: a one-token forward and a draft's verification sum in different
    orders, as two plain batch sizes do, so such a tie may break either way; each response that differs
    must do so first at such a tie."""
    from tlt.audit import engine_for
    from tlt.rollout import SamplingParams

    target = random_target(seed=5).to(torch.bfloat16)
    drafter = Drafter.from_target(target, seed=3).eval()
    sampled = audit(target, None, prompts(), ["off", "chain-d3", "tree-d3-k3-v8", "ngram-d3"], drafter, samples=48,
                    max_tokens=24, seed=1)
    assert sampled["passed"], sampled
    params = [SamplingParams(temperature=0.0, max_tokens=24) for _ in prompts()]
    plain = [o.outputs[0].token_ids for o in engine_for(target, None, "off", None).generate(prompts(), params)]
    agreeing = 0
    for system in ["chain-d3", "tree-d3-k3-v8", "ngram-d3"]:
        outputs = engine_for(target, None, system, drafter).generate(prompts(), params)
        for prompt, reference, o in zip(prompts(), plain, outputs):
            response = o.outputs[0].token_ids
            if response == reference:
                agreeing += 1
                continue
            j = next(i for i, (a, b) in enumerate(zip(response, reference)) if a != b)
            with torch.inference_mode():
                logits = target(torch.tensor([prompt + reference[:j]])).logits[0, -1].float()
            best, second = logits.topk(2).values.tolist()
            ulp = 2.0 ** (torch.tensor(abs(best)).log2().floor().item() - 7)  # bf16 spacing at the best logit
            assert best - second <= 2 * ulp, (system, prompt, j, best, second)
    assert agreeing >= 10  # of 12: ties are rare


def test_a_verifier_with_the_classic_bias_fails(monkeypatch):
    """The control: after a rejection, drawing the replacement from p instead of normalise(max(p - q, 0))
    over-weights the tokens the drafter proposes."""
    from tlt.rollout.sampling import sample_from
    from tlt.speculative import decoder, verify

    def resample_from_p(p, q, draft, u_accept, u_final):
        count, _ = verify.speculative_sample_chain(p, q, draft, u_accept, u_final)
        return count, sample_from(p[torch.arange(len(count)), count].log(), u_final)

    monkeypatch.setattr(decoder, "speculative_sample_chain", resample_from_p)
    target = random_target(seed=5)
    result = audit(target, None, prompts(), ["chain-d3"], Drafter.from_target(target, seed=3).eval(), samples=48,
                   max_tokens=24, seed=1)
    chain = result["systems"]["chain-d3"]
    assert not result["passed"] and chain["ks_p"] < 1e-6 and chain["score_p"] < 1e-6


def test_greedy_is_checked_token_for_token():
    target = random_target(seed=6)
    result = audit(target, None, prompts(), ["chain-d3", "tree-d3-k3-v8", "ngram-d3"],
                   Drafter.from_target(target, seed=3).eval(), samples=1, temperature=0.0, max_tokens=24)
    assert result["passed"]
    assert all(r["responses_differing"] == 0 for r in result["systems"].values())


def test_cli_writes_the_record_and_names_a_bad_system(tmp_path, capsys, monkeypatch):
    from test_bench_speculative import tiny_folders as folders_fixture

    model_dir, _ = folders_fixture.__wrapped__(tmp_path)
    out = tmp_path / "audit.json"
    monkeypatch.setattr(audit_module, "LOGIT_BUDGET", 2000)  # several teacher-forced chunks
    monkeypatch.setattr(audit_module, "POSITION_BUDGET", 100)  # and several position chunks per response
    code = main(["audit", "--model", str(model_dir), "--drafter", "random", "--systems", "off,tree-d3-k2-v4",
                 "--prompts", "3", "--samples", "8", "--max-tokens", "12", "--dtype", "bfloat16", "--json", str(out)])
    record = json.loads(out.read_text())
    assert code == (0 if record["passed"] else 1)
    assert set(record["systems"]) == {"off", "tree-d3-k2-v4"} and record["config"]["samples"] == 8
    assert record["config"]["dtype"] == "bfloat16"
    assert "KS p" in capsys.readouterr().out
    assert main(["audit", "--model", str(model_dir), "--systems", "off,bushy-d3"]) == 2
    assert "bushy-d3" in capsys.readouterr().err


def test_cli_audits_the_prompts_of_a_dataset(tmp_path, capsys):
    """--dataset F --prompt-column C: the audit samples from the dataset's prompts (all of them when
    --prompts asks for more), and a column the file lacks is refused naming it."""
    from test_bench_speculative import tiny_folders as folders_fixture

    from tlt.tokenizer import load_tokenizer

    model_dir, _ = folders_fixture.__wrapped__(tmp_path)
    questions = ["Q:1+2\nA:", "Q:3*4-1\nA:", "Q:5-1+7\nA:"]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "0"}) + "\n" for q in questions))
    args = audit_module.argparse.Namespace(dataset=str(data), prompt_column="question", prompts=5, samples=8, seed=0)
    tokenizer = load_tokenizer(model_dir)
    assert audit_module.load_prompts(args, tokenizer) == [tokenizer.encode(q) for q in questions]
    out = tmp_path / "audit.json"
    code = main(["audit", "--model", str(model_dir), "--drafter", "random", "--systems", "off,ngram-d3",
                 "--dataset", str(data), "--prompt-column", "question", "--prompts", "5", "--samples", "8",
                 "--max-tokens", "12", "--json", str(out)])
    record = json.loads(out.read_text())
    assert code == (0 if record["passed"] else 1)
    assert record["config"]["dataset"] == str(data) and all(r["tokens"] > 0 for r in record["systems"].values())
    assert "3 prompts x 8 samples" in capsys.readouterr().err
    assert main(["audit", "--model", str(model_dir), "--dataset", str(data), "--prompt-column", "problem"]) == 2
    err = capsys.readouterr().err
    assert "problem" in err and "prompts.jsonl" in err


def test_chunking_the_teacher_forced_pass_changes_nothing(monkeypatch):
    import tlt

    target = random_target(seed=8)
    ps = prompts()
    params = tlt.SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=20, seed=2)
    out = tlt.RolloutEngine(target).generate(ps, params)
    owners = [list(o.prompt_token_ids) for o in out for _ in o.outputs]
    responses = [c.token_ids for o in out for c in o.outputs]
    whole = audit_module.teacher_forced(target, owners, responses, params, v_seed=5)
    monkeypatch.setattr(audit_module, "LOGIT_BUDGET", 500)
    monkeypatch.setattr(audit_module, "POSITION_BUDGET", 61 * 3)
    parts = audit_module.teacher_forced(target, owners, responses, params, v_seed=5)
    assert len(whole) == len(parts) == len(responses)
    for a, b in zip(whole, parts):
        for key in a:
            assert torch.allclose(a[key].double(), b[key].double(), atol=1e-9), key
