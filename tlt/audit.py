"""`tlt audit`: check, on your own model, drafter and sampling settings, that speculative sampling draws
from the target's own distribution.

Method. Responses are generated with speculation on; then a teacher-forced forward of the target over
each prompt + response gives, at every generated position t, the warped distribution p_t (temperature,
top-k, top-p, exactly as plain sampling warps it) that the token x_t should have been drawn from. Two
statistics follow, each exact under the null "x_t ~ p_t given its prefix" whatever the vocabulary size:

  - randomized probability integral transform. Rank p_t's tokens by probability (descending, ties by
    token id) and set u_t = p_t(ranked before x_t) + v_t * p_t(x_t) with v_t ~ U(0, 1) drawn apart.
    Under the null every u_t is uniform given its past, so the u_t are i.i.d. U(0, 1) and their pooled
    empirical distribution is tested against U(0, 1) with Kolmogorov-Smirnov. The ranking puts the
    likeliest tokens near 0: a verifier that keeps too many likely drafts pushes u towards 0, one
    that keeps unlikely drafts pushes it towards 1.
  - log-probability score. With H_t the entropy of p_t, each log p_t(x_t) + H_t has mean 0 and
    variance sum p (log p)^2 - H_t^2 given its past (martingale differences), so z = sum of them /
    sqrt(sum of the variances) is close to standard normal. A too-peaked sampler gives z > 0, a
    too-flat one z < 0.

A system passes when both p-values exceed `alpha` and no sampled token lies outside its p_t's support
(removed by top-k / top-p). Plain sampling ("off") is audited the same way, as a reference. At
temperature 0 the check is exact instead: every system's tokens must equal plain greedy decoding's.
The tests hold a verifier with a deliberate bias to it, which fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tlt.bench import comma_list, engine_config
from tlt.config import integer_flag, number_flag
from tlt.model.checkpoint import DTYPE_NAMES

DEFAULT_SYSTEMS = ("off", "chain-d4", "tree-d4-k4-v16", "ngram-d4", "adaptive")
LOGIT_BUDGET = 1 << 26  # logits (floats) one teacher-forced forward may hold
POSITION_BUDGET = 1 << 22  # vocabulary entries of the per-position statistics held at once


# --- statistics ------------------------------------------------------------------------------------
def kolmogorov_p(d: float, n: int) -> float:
    """P(D_n >= d) for the one-sample Kolmogorov-Smirnov statistic, by the asymptotic Kolmogorov
    distribution with Stephens' small-sample correction (accurate to about 1% for n >= 35)."""
    if n <= 0:
        return 1.0
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:
        return 1.0
    total = sum((-1) ** (j - 1) * math.exp(-2.0 * j * j * lam * lam) for j in range(1, 101))
    return min(1.0, max(0.0, 2.0 * total))


def ks_uniform(u) -> tuple[float, float]:
    """(D, p-value) of the one-sample KS test of the values `u` (a 1-D tensor) against U(0, 1)."""
    import torch

    n = int(u.numel())
    if n == 0:
        return 0.0, 1.0
    s = u.double().sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max(float((i / n - s).max()), float((s - (i - 1) / n).max()))
    return d, kolmogorov_p(d, n)


def position_statistics(logprobs, tokens, v) -> dict:
    """Per-position terms for the warped log-probs [T, V] of the positions where tokens [T] were drawn,
    with independent uniforms v [T]: the randomized PIT u [T], log p(x) [T], entropy H [T], the
    variance of log p(x) [T], and a [T] mask of tokens with zero probability."""
    import torch

    lp = logprobs.double()
    p = lp.exp()
    x = tokens.long()[:, None]
    px = p.gather(1, x)  # [T, 1]
    ids = torch.arange(lp.shape[1], device=lp.device)[None]
    ranked_before = (p > px) | ((p == px) & (ids < x))
    u = (p * ranked_before).sum(1) + v.double() * px[:, 0]
    support = p > 0
    plogp = torch.where(support, p * lp, torch.zeros_like(p))
    entropy = -plogp.sum(1)
    second = torch.where(support, p * lp * lp, torch.zeros_like(p)).sum(1)
    return {"u": u, "logp": lp.gather(1, x)[:, 0], "entropy": entropy,
            "variance": (second - entropy * entropy).clamp(min=0.0), "outside": px[:, 0] <= 0}


def verdict(stats: list[dict], alpha: float) -> dict:
    """Pool per-position terms of many responses into the two tests and a pass / fail."""
    import torch

    if not stats:
        return {"tokens": 0, "ks_d": 0.0, "ks_p": 1.0, "score_z": 0.0, "score_p": 1.0, "outside_support": 0,
                "mean_entropy": 0.0, "passed": False, "reason": "no generated tokens to test"}
    u = torch.cat([s["u"] for s in stats])
    outside = int(sum(int(s["outside"].sum()) for s in stats))
    inside = torch.cat([~s["outside"] for s in stats])
    logp = torch.cat([s["logp"] for s in stats])[inside]
    entropy = torch.cat([s["entropy"] for s in stats])[inside]
    variance = float(torch.cat([s["variance"] for s in stats])[inside].sum())
    d, ks_p = ks_uniform(u)
    score = float((logp + entropy).sum())
    z = score / math.sqrt(variance) if variance > 0 else 0.0
    z_p = math.erfc(abs(z) / math.sqrt(2.0)) if variance > 0 else 1.0
    reasons = []
    if outside:
        reasons.append(f"{outside} sampled token(s) outside the warped support")
    if ks_p <= alpha:
        reasons.append(f"PIT not uniform (KS p = {ks_p:.2g})")
    if z_p <= alpha:
        reasons.append(f"log-prob score z = {z:.2f} (p = {z_p:.2g}): too {'peaked' if z > 0 else 'flat'}")
    return {"tokens": int(u.numel()), "ks_d": d, "ks_p": ks_p, "score_z": z, "score_p": z_p, "outside_support": outside,
            "mean_entropy": float(entropy.mean()) if entropy.numel() else 0.0,
            "passed": not reasons, "reason": "; ".join(reasons)}


# --- the audit -------------------------------------------------------------------------------------
def teacher_forced(model, prompts: list[list[int]], responses: list[list[int]], params, v_seed: int) -> list[dict]:
    """Per-response position statistics under the target's warped distributions, by forwards over
    prompt + response in chunks that keep the logits within LOGIT_BUDGET."""
    import torch

    from tlt.rollout.sampling import warp_logprobs

    device = model.device
    gen = torch.Generator().manual_seed(v_seed)
    order = [i for i, r in enumerate(responses) if r]
    out: list[dict] = []
    V = model.config.vocab_size
    start = 0
    while start < len(order):
        width = len(prompts[order[start]]) + len(responses[order[start]])
        rows = max(1, LOGIT_BUDGET // max(1, width * V))
        chunk = order[start : start + rows]
        start += len(chunk)
        seqs = [prompts[i] + responses[i] for i in chunk]
        T = max(map(len, seqs))
        ids = torch.zeros(len(seqs), T, dtype=torch.long, device=device)
        mask = torch.zeros(len(seqs), T, dtype=torch.bool, device=device)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s, device=device)
            mask[r, : len(s)] = True
        with torch.inference_mode():
            logits = model(ids, attention_mask=mask).logits.float()
        step = max(1, POSITION_BUDGET // V)  # positions whose [positions, V] statistics are held at once
        for r, i in enumerate(chunk):
            n, m = len(prompts[i]), len(responses[i])
            tokens, v = torch.tensor(responses[i]), torch.rand(m, generator=gen, dtype=torch.float64)
            parts = []
            for a in range(0, m, step):
                b = min(m, a + step)
                rows_logits = logits[r, n - 1 + a : n - 1 + b]  # the distributions tokens a..b-1 were drawn from
                k = b - a
                lp = warp_logprobs(rows_logits, torch.full((k,), params.temperature, device=device),
                                   torch.full((k,), params.top_k, dtype=torch.long, device=device),
                                   torch.full((k,), params.top_p, device=device))
                parts.append(position_statistics(lp.cpu(), tokens[a:b], v[a:b]))
            out.append({key: torch.cat([p[key] for p in parts]) for key in parts[0]})
    return out


def engine_for(model, tokenizer, system: str, drafter):
    from tlt.rollout import RolloutEngine

    return RolloutEngine(model, tokenizer, engine_config(system, drafter, progress=False))


def audit(model, tokenizer, prompts: list[list[int]], systems: list[str], drafter=None, samples: int = 16,
          temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, max_tokens: int = 128, seed: int = 0,
          alpha: float = 1e-3, log: Callable[[str], None] = lambda s: None) -> dict:
    """Audit each system (off, adaptive or a strategy name) on `prompts`; returns {"systems": {name:
    verdict}, "passed": bool}. A learned-drafter strategy needs `drafter`."""
    from tlt.rollout import SamplingParams

    results: dict[str, Any] = {}
    params = [SamplingParams(n=samples, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                             seed=seed * 100003 + j) for j in range(len(prompts))]
    greedy_reference = None
    for k, system in enumerate(systems):
        start = time.perf_counter()
        outputs = engine_for(model, tokenizer, system, drafter).generate(prompts, params, use_tqdm=False)
        responses = [c.token_ids for o in outputs for c in o.outputs]
        owners = [list(o.prompt_token_ids) for o in outputs for _ in o.outputs]
        if temperature == 0:
            if greedy_reference is None:
                reference = engine_for(model, tokenizer, "off", None).generate(prompts, params, use_tqdm=False)
                greedy_reference = [c.token_ids for o in reference for c in o.outputs]
            differ = sum(a != b for a, b in zip(responses, greedy_reference))
            result = {"tokens": sum(map(len, responses)), "responses_differing": differ, "passed": differ == 0,
                      "reason": f"{differ} of {len(responses)} responses differ from plain greedy decoding" if differ else ""}
        else:
            result = verdict(teacher_forced(model, owners, responses, params[0], seed * 7919 + k), alpha)
        result["seconds"] = time.perf_counter() - start
        results[system] = result
        log(f"  {system:20s} {'pass' if result['passed'] else 'FAIL'}  {result['tokens']} tokens"
            + (f"  ({result['reason']})" if result["reason"] else ""))
    return {"systems": results, "passed": all(r["passed"] for r in results.values())}


# --- command line ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="a Hugging Face folder (Llama, Qwen2, Qwen3) or 'default'")
    parser.add_argument("--drafter", default="auto",
                        help="drafter folder, 'default', 'references', 'random' (verification must be exact for any "
                             "drafter), 'none' (n-gram and off only) or 'auto' (the built-in one for the default model, "
                             "else random)")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help="comma-separated: off, adaptive and strategy names such as tree-d6-k4-v24, chain-d4, ngram-d4")
    parser.add_argument("--dataset", default=None, help="JSONL or Parquet prompts (verl or TRL layout); default: the "
                                                        "built-in task's held-out problems")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--prompts", type=integer_flag(1), default=16, help="prompts to use")
    parser.add_argument("--samples", type=integer_flag(1), default=16, help="samples per prompt")
    parser.add_argument("--temperature", type=number_flag, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--max-tokens", type=integer_flag(1), default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=1e-3, help="a p-value at or below this fails")
    parser.add_argument("--threads", type=integer_flag(0), default=0)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="the weights' dtype, as the rollout engine will run them")
    parser.add_argument("--json", default=None, help="also write the settings and every verdict here")


def load_prompts(args, tokenizer) -> list[list[int]]:
    from tlt.errors import ConfigError

    if args.prompts < 1 or args.samples < 1:
        raise ConfigError("--prompts and --samples must be >= 1")
    if args.dataset:
        from tlt.chat import render_prompt
        from tlt.data.datasets import load_examples

        examples = load_examples(args.dataset, prompt_column=args.prompt_column, limit=args.prompts)
        return [render_prompt(tokenizer, ex.prompt) for ex in examples]
    from tlt.tasks import ArithmeticTask

    return [tokenizer.encode(p.prompt) for p in ArithmeticTask().sample(args.prompts, seed=args.seed, split="eval")]


def uses_drafter(systems: list[str]) -> bool:
    """Whether any system drafts with a learned drafter (adaptive has chain and tree arms)."""
    from tlt.speculative import Strategy

    return any(s == "adaptive" or (s != "off" and Strategy.parse(s).uses_drafter) for s in systems)


def load_drafter(name: str, model_name: str, model, systems: list[str]):
    from tlt.speculative import Drafter

    if name == "none" or not uses_drafter(systems):
        return None
    if name == "auto":
        name = "default" if model_name == "default" else "random"
    if name == "random":
        return Drafter.from_target(model, seed=0).eval()
    return Drafter.load(name, model)


def run(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from tlt.device import resolve_device
    from tlt.errors import ConfigError
    from tlt.io import atomic_write_json
    from tlt.model import load_model
    from tlt.speculative import Strategy
    from tlt.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    systems = comma_list(args.systems)
    for s in systems:
        if s not in ("off", "adaptive"):
            try:
                Strategy.parse(s)
            except ConfigError as exc:
                raise ConfigError(f"--systems: {s!r} is neither off, adaptive nor a strategy name ({exc})") from None
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha must be in (0, 1), got {args.alpha}")
    device = resolve_device(args.device, "--device")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=device).eval(), load_tokenizer(args.model)
    drafter = load_drafter(args.drafter, args.model, model, systems)
    if drafter is None and uses_drafter(systems):
        raise ConfigError("--drafter none leaves no drafter for the chain/tree strategies and 'adaptive' in --systems")
    prompts = load_prompts(args, tokenizer)
    print(f"tlt audit: {args.model} ({args.dtype}), {len(prompts)} prompts x {args.samples} samples, temperature {args.temperature}, "
          f"top_p {args.top_p}, top_k {args.top_k}, alpha {args.alpha}", file=sys.stderr)
    record = audit(model, tokenizer, prompts, systems, drafter, args.samples, args.temperature, args.top_p, args.top_k,
                   args.max_tokens, args.seed, args.alpha, log=lambda s: print(s, file=sys.stderr))
    print(format_table(record, args.temperature))
    if args.json:
        record["config"] = {"command": shlex.join(sys.argv), **{k: v for k, v in vars(args).items() if k != "_module"}}
        atomic_write_json(Path(args.json), record)
        print(f"wrote {args.json}")
    return 0 if record["passed"] else 1


def format_table(record: dict, temperature: float) -> str:
    if temperature == 0:
        header = f"{'system':20s}  {'tokens':>8}  {'differing':>9}  verdict"
        lines = [header, "-" * len(header)]
        for name, r in record["systems"].items():
            lines.append(f"{name:20s}  {r['tokens']:>8}  {r['responses_differing']:>9}  {'pass' if r['passed'] else 'FAIL'}")
        return "\n".join(lines)
    header = f"{'system':20s}  {'tokens':>8}  {'KS D':>7}  {'KS p':>8}  {'score z':>8}  {'z p':>8}  verdict"
    lines = [header, "-" * len(header)]
    for name, r in record["systems"].items():
        lines.append(f"{name:20s}  {r['tokens']:>8}  {r['ks_d']:>7.4f}  {r['ks_p']:>8.3g}  {r['score_z']:>8.2f}  "
                     f"{r['score_p']:>8.3g}  {'pass' if r['passed'] else 'FAIL: ' + r['reason']}")
    return "\n".join(lines)
