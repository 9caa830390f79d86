"""`tlt train-drafter`: offline EAGLE training of a drafter on the target's own generations.

Data, pairing and packing live in speculative/data.py; this module is the loss, the loop and the
command line.

Loss (`eagle_loss`): SmoothL1(f_hat, f) * feature_weight + token_weight * soft cross-entropy of the
drafter's distribution against the target's, over response pairs only. With `unroll` k > 1 the
drafter is also trained on its own inputs ("training-time test"): round r > 1 replaces the feature at
t by the previous round's prediction of it, f_hat_{r-1}[t-1], keeping the true feature at the start
of each record, with the same targets; the loss is the mean over rounds and gradients flow through
the rounds. This approximates deep drafting, where only the newest features are the drafter's own.

The feature target f is the target's last hidden state after its final norm, the input of its LM
head, which is also what f_hat feeds (the drafter has no output norm). Only the drafter's fc, decoder
layer (and fusion) train; the target's embedding and LM head are used under no_grad and never reach
the optimizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tlt.config import build, integer_flag, number_flag, to_dict
from tlt.errors import ConfigError
from tlt.speculative.data import (DraftRecord, PackedBatch, collect, fill_rows, pack, packed_batches, record_pairs,
                                  records_from_texts)


# --- loss ------------------------------------------------------------------------------------------
def eagle_loss(
    f_hat: torch.Tensor, f_target: torch.Tensor, drafter_logits: torch.Tensor, target_logits: torch.Tensor,
    mask: torch.Tensor, feature_weight: float = 1.0, token_weight: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The EAGLE loss over valid pairs. f_hat, f_target [B, T, H]; logits [B, T, V]; mask [B, T].
    Metrics: the two terms, token_kl (the cross-entropy less the target's entropy: 0 at the optimum),
    top1 (drafter argmax == target argmax) and accept (the target's probability of the drafter's argmax:
    how often target-only verification at temperature 1 accepts a one-token draft of it)."""
    m = mask.float()  # [B, T]
    n = m.sum().clamp(min=1)
    feature = F.smooth_l1_loss(f_hat.float(), f_target.float(), reduction="none").mean(-1)  # [B, T]
    p = F.softmax(target_logits.float(), -1)  # [B, T, V]
    log_p = F.log_softmax(target_logits.float(), -1)  # [B, T, V]
    log_q = F.log_softmax(drafter_logits.float(), -1)  # [B, T, V]
    ce = -(p * log_q).sum(-1)  # [B, T]
    kl = (p * (log_p - log_q)).sum(-1)  # [B, T]
    guess = drafter_logits.argmax(-1)  # [B, T]
    top1 = (guess == target_logits.argmax(-1)).float()  # [B, T]
    accept = p.gather(-1, guess[..., None])[..., 0]  # [B, T]
    feature_loss, token_loss = (feature * m).sum() / n, (ce * m).sum() / n
    loss = feature_weight * feature_loss + token_weight * token_loss
    metrics = {"loss": loss.item(), "feature_loss": feature_loss.item(), "token_loss": token_loss.item(),
               "token_kl": ((kl * m).sum() / n).item(), "top1": ((top1 * m).sum() / n).item(),
               "accept": ((accept * m).sum() / n).item()}
    return loss, metrics


# --- training --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterTrainConfig:
    """batch_tokens pairs per optimizer step, in `rows` rows of batch_tokens // rows; `window`: the last
    pairs of each record trained on; `unroll`: training-time-test rounds; `feature_layers`: target
    layers a fresh drafter fuses (EAGLE-3 style; None: the last-layer feature)."""

    steps: int = 1000
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    batch_tokens: int = 4096
    rows: int = 4
    window: int = 512
    unroll: int = 1
    feature_weight: float = 1.0
    token_weight: float = 0.1
    grad_clip: float = 1.0
    feature_layers: tuple[int, ...] | None = None
    seed: int = 0
    threads: int = 0
    log_every: int = 50

    def __post_init__(self) -> None:
        checks = [
            ("steps", self.steps >= 1, ">= 1"), ("lr", self.lr > 0, "> 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("rows", self.rows >= 1, ">= 1"), ("window", self.window >= 1, ">= 1"),
            ("batch_tokens", self.batch_tokens // max(self.rows, 1) >= self.window,
             f"at least rows * window = {self.rows * self.window} (a window must fit a row)"),
            ("unroll", self.unroll >= 1, ">= 1"), ("feature_weight", self.feature_weight >= 0, ">= 0"),
            ("token_weight", self.token_weight >= 0, ">= 0"), ("grad_clip", self.grad_clip > 0, "> 0"),
            ("threads", self.threads >= 0, ">= 0"), ("log_every", self.log_every >= 1, ">= 1"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"DrafterTrainConfig field {name!r} must be {expected}, got {getattr(self, name)!r}")
        if self.feature_weight == 0 and self.token_weight == 0:
            raise ConfigError("DrafterTrainConfig fields 'feature_weight' and 'token_weight' cannot both be 0")

    @property
    def row_tokens(self) -> int:
        return self.batch_tokens // self.rows


def true_features(drafter, batch: PackedBatch) -> torch.Tensor:
    """The drafter's view of the target features at the pairs: [R, L, H] (fused for EAGLE-3)."""
    if batch.layers is None:
        return batch.inputs
    layer_states = {k: batch.layers[:, :, j] for j, k in enumerate(drafter.output_layers)}  # k -> [R, L, H]
    return drafter.target_features(batch.inputs, layer_states)


def unrolled_loss(drafter, batch: PackedBatch, c: DrafterTrainConfig,
                  between_rounds: Callable[[], None] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The EAGLE loss averaged over `c.unroll` training-time-test rounds (see the module docstring).
    `between_rounds()` runs before each round after the first (the spot trainer's stop check)."""
    with torch.no_grad():
        target_logits = drafter.target.lm_head(batch.targets)  # [R, L, V]
    f_true = true_features(drafter, batch)  # [R, L, H]
    starts = (batch.positions == 0)[..., None]  # [R, L, 1] first pair of each window
    features, losses, metrics = f_true, [], {}
    for r in range(1, c.unroll + 1):
        if r > 1 and between_rounds is not None:
            between_rounds()
        f_hat, logits = drafter(batch.tokens, features, batch.positions, attention_mask=batch.mask)  # [R, L, H/V]
        loss, m = eagle_loss(f_hat, batch.targets, logits, target_logits, batch.mask,
                             c.feature_weight, c.token_weight)
        losses.append(loss)
        metrics.update(m if r == 1 else {f"top1@{r}": m["top1"], f"accept@{r}": m["accept"]})
        # f_hat[t-1] is the drafter's guess of the feature at t: next round it stands in for f[t].
        features = torch.where(starts, f_true, torch.cat([f_true[:, :1], f_hat[:, :-1]], 1))  # [R, L, H]
    total = torch.stack(losses).mean()
    metrics["loss"] = total.item()
    return total, metrics


def lr_at(step: int, c: DrafterTrainConfig) -> float:
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
    return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def check_records(drafter, records: list[DraftRecord]) -> None:
    want = drafter.output_layers
    for i, r in enumerate(records):
        if (r.layers is None) != (not want) or (want and r.layer_ids != want):
            raise ConfigError(f"record {i} has target layers {r.layer_ids} but the drafter reads {want}; "
                              f"collect with output_layers=drafter.output_layers")


def train_drafter(target, records: list[DraftRecord], config: DrafterTrainConfig, drafter=None, log=print):
    """Train `drafter` (a fresh one when None) on `records`; returns (drafter, final metrics), the
    metrics averaged over the last logging interval."""
    from tlt.speculative.drafter import Drafter

    c = config
    if c.threads:
        torch.set_num_threads(c.threads)
    if drafter is None:
        drafter = Drafter.from_target(target, feature_layers=c.feature_layers, seed=c.seed)
    elif drafter.target is not target:
        raise ConfigError("the drafter was built for another target model")
    check_records(drafter, records)
    pairs = [p for p in (record_pairs(r, c.window) for r in records) if len(p)]
    if not pairs:
        raise ConfigError("no training pairs: every record has fewer than 2 response tokens")
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=c.lr, weight_decay=c.weight_decay, betas=(0.9, 0.95))
    batches = packed_batches(pairs, c.rows, c.row_tokens, c.seed)
    start, window_metrics, metrics = time.time(), [], {}
    for step in range(c.steps):
        batch = next(batches).to(target.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, c)
        loss, m = unrolled_loss(drafter, batch, c)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), c.grad_clip)
        opt.step()
        window_metrics.append(m)
        if (step + 1) % c.log_every == 0 or step + 1 == c.steps:
            elapsed = time.time() - start
            metrics = {k: round(sum(w[k] for w in window_metrics) / len(window_metrics), 4) for k in m}
            metrics.update(step=step + 1, elapsed_s=round(elapsed, 1))
            log(f"step {step + 1:5d}  loss {metrics['loss']:.4f}  feature {metrics['feature_loss']:.4f}  "
                f"token {metrics['token_loss']:.4f}  top1 {metrics['top1']:.3f}  lr {lr_at(step, c):.2e}  "
                f"{(step + 1) * c.batch_tokens / elapsed:,.0f} pairs/s")
            window_metrics = []
    metrics.update(records=len(records), pairs=sum(len(p) for p in pairs))
    # The longest context its attention has now been trained over (a continued drafter keeps the larger).
    trained = max(drafter.config.train_window or 0, max(len(p) for p in pairs))
    drafter.config = dataclasses.replace(drafter.config, train_window=trained)
    return drafter.eval(), metrics


@torch.no_grad()
def acceptance_top1(drafter, records: list[DraftRecord], rows: int = 8) -> float:
    """Teacher-forced top-1 agreement of drafter and target over every pair of `records`: the rate at
    which a one-token greedy draft is accepted."""
    check_records(drafter, records)
    pairs = [p for p in (record_pairs(r) for r in records) if len(p)]
    if not pairs:
        raise ConfigError("no pairs to evaluate: every record has fewer than 2 response tokens")
    L = max(len(p) for p in pairs)
    packed_rows = list(fill_rows(iter(pairs), L))
    agree = total = 0
    for s in range(0, len(packed_rows), rows):
        batch = pack(packed_rows[s : s + rows], L).to(drafter.target.device)
        _, logits = drafter(batch.tokens, true_features(drafter, batch), batch.positions,
                            attention_mask=batch.mask)  # [R, L, V]
        target_top = drafter.target.lm_head(batch.targets).argmax(-1)  # [R, L]
        agree += int(((logits.argmax(-1) == target_top) & batch.mask).sum())
        total += int(batch.mask.sum())
    return agree / total


def check_target_only(strategy: str, what: str) -> None:
    from tlt.speculative.strategy import Strategy

    if not Strategy.parse(strategy).target_only:
        raise ConfigError(f"{what} must be a target-only strategy (tree or ngram), got {strategy!r}")


def held_out_acceptance(drafter, tokenizer, prompts, samples_per_prompt: int, temperature: float,
                        max_tokens: int, seed: int, strategy: str = "tree-d4-k2-v8") -> tuple[float, list[list[int]]]:
    """(acceptance length, the responses' token ids) of speculative decoding with `drafter` under
    `strategy` on `prompts`, drawn with `collect`'s sampling parameters for the same arguments.

    Teacher-forced top-1 judges one draft token from the true feature; drafting deeper feeds the
    drafter its own predicted features, which top-1 does not see (a drafter can agree more often at
    top-1 than another and still accept fewer tokens per tree step). A target-only strategy (`Strategy.target_only`) draws the same responses whatever the
    drafter, so two drafters measured on the same prompts and seeds are compared on paired samples."""
    from tlt.rollout import EngineConfig, RolloutEngine
    from tlt.speculative.data import generation_params

    check_target_only(strategy, "held-out acceptance")
    engine = RolloutEngine(drafter.target, tokenizer,
                           EngineConfig(speculative="on", strategy=strategy, drafter=drafter, progress=False))
    outs = engine.generate(prompts, generation_params(len(prompts), samples_per_prompt, temperature, max_tokens, seed))
    return engine.rollout_stats.acceptance_length(), [list(c.token_ids) for o in outs for c in o.outputs]


# --- command line ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.tasks import task_names

    parser.add_argument("--model", default="default", help="target model folder or built-in name")
    parser.add_argument("--out", required=True, help="output drafter folder")
    parser.add_argument("--from-drafter", help="drafter folder to continue training from")
    parser.add_argument("--data", choices=("generations", "references"), default="generations",
                        help="train on the target's own samples, or on the task's reference solutions "
                             "(text the policy did not write, as a drafter trained on generic data)")
    parser.add_argument("--prompts", type=integer_flag(1), default=256, help="train-split problems to generate on")
    parser.add_argument("--samples", type=integer_flag(1), default=4, help="samples per problem")
    parser.add_argument("--temperature", type=number_flag, default=1.0)
    parser.add_argument("--max-tokens", type=integer_flag(1), default=768)
    parser.add_argument("--eval-prompts", type=integer_flag(1), default=32, help="eval-split problems for acceptance")
    parser.add_argument("--eval-strategy", default="tree-d4-k2-v8",
                        help="target-only strategy whose acceptance length on the held-out prompts is reported "
                             "before and after training ('none': top-1 agreement only)")
    parser.add_argument("--task", default="arithmetic", choices=task_names(),
                        help="the built-in task (or named task configuration) the prompts come from")
    parser.add_argument("--dataset", help="JSONL or Parquet prompts (verl or TRL layout, chat prompts through the "
                                          "tokenizer's template) instead of the built-in task")
    parser.add_argument("--eval-dataset", help="held-out prompts (default: the --eval-prompts rows after the "
                                               "training rows of --dataset)")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--completion-column", default=None,
                        help="with --data references and --dataset: the column holding the reference completions")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--config", help="YAML file of DrafterTrainConfig fields")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="DrafterTrainConfig fields")


def prompt_sources(args, tokenizer, seed: int) -> dict[str, tuple[list, list | None]]:
    """{"train": (prompts, reference completions or None), "eval": (...)}: the built-in task's train and
    eval splits, or the rows of --dataset (held out: --eval-dataset, else the rows after the training
    ones). Prompts are token ids (chat prompts rendered with the tokenizer's template)."""
    if args.prompts < 1 or args.eval_prompts < 1:
        raise ConfigError("--prompts and --eval-prompts must be >= 1")
    if not args.dataset:
        from tlt.tasks import get_task

        if args.eval_dataset or args.completion_column:
            raise ConfigError("--eval-dataset and --completion-column need --dataset")
        task = get_task(args.task)
        out = {}
        for split, n in (("train", args.prompts), ("eval", args.eval_prompts)):
            problems = task.sample(n, seed=seed, split=split)
            out[split] = ([p.prompt for p in problems], [p.solution for p in problems])
        return out
    from tlt.chat import render_prompt
    from tlt.data.datasets import load_examples

    if args.data == "references" and not args.completion_column:
        raise ConfigError("--data references with --dataset needs --completion-column, the column holding the "
                          "reference completions")
    rows = load_examples(args.dataset, prompt_column=args.prompt_column,
                         limit=args.prompts + (0 if args.eval_dataset else args.eval_prompts))
    if args.eval_dataset:
        train_rows, eval_rows = rows, load_examples(args.eval_dataset, prompt_column=args.prompt_column,
                                                    limit=args.eval_prompts)
    else:
        if len(rows) < 2:
            raise ConfigError(f"{args.dataset}: {len(rows)} row(s), too few to hold any out; give --eval-dataset")
        cut = min(args.prompts, len(rows) - max(1, min(args.eval_prompts, len(rows) // 2)))
        train_rows, eval_rows = rows[:cut], rows[cut:]

    def completions(examples):
        if not args.completion_column:
            return None
        missing = [ex.source for ex in examples if not isinstance(ex.columns.get(args.completion_column), str)]
        if missing:
            raise ConfigError(f"{missing[0]}: column {args.completion_column!r} is missing or not text "
                              "(expected the reference completion)")
        return [ex.columns[args.completion_column] for ex in examples]

    return {"train": ([render_prompt(tokenizer, ex.prompt) for ex in train_rows], completions(train_rows)),
            "eval": ([render_prompt(tokenizer, ex.prompt) for ex in eval_rows], None)}


def run(args: argparse.Namespace) -> int:
    from tlt.device import resolve_device
    from tlt.model import load_model
    from tlt.io import atomic_write_json
    from tlt.speculative.drafter import Drafter
    from tlt.tokenizer import load_tokenizer

    c = build(DrafterTrainConfig, args.config, args.overrides)
    command = "tlt " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["train-drafter"] else "tlt train-drafter"
    if c.threads:
        torch.set_num_threads(c.threads)
    device = resolve_device(args.device, "--device")
    target, tokenizer = load_model(args.model, device=device), load_tokenizer(args.model)
    if args.from_drafter:
        drafter = Drafter.load(args.from_drafter, target)
        if c.feature_layers is not None and tuple(c.feature_layers) != drafter.output_layers:
            raise ConfigError(f"field 'feature_layers' is {c.feature_layers} but {args.from_drafter} "
                              f"reads {drafter.output_layers}")
    else:
        drafter = Drafter.from_target(target, c.feature_layers, seed=c.seed)
    sources = prompt_sources(args, tokenizer, c.seed)

    def gather(split: str, data: str = "generations") -> list[DraftRecord]:
        prompts, completions = sources[split]
        if data == "references":
            return records_from_texts(target, tokenizer, prompts, completions, drafter.output_layers)
        return collect(target, tokenizer, prompts, args.samples, args.temperature, args.max_tokens, c.seed,
                       drafter.output_layers)

    eval_strategy = None if args.eval_strategy == "none" else args.eval_strategy
    if eval_strategy is not None:
        check_target_only(eval_strategy, "--eval-strategy (or 'none')")

    def accepted() -> float:
        length, _ = held_out_acceptance(drafter, tokenizer, sources["eval"][0], args.samples, args.temperature,
                                        args.max_tokens, c.seed, eval_strategy)
        return round(length, 4)

    start = time.time()
    train = "the reference texts" if args.data == "references" else f"{args.samples} samples each"
    print(f"collecting {train} of {len(sources['train'][0])} prompts and {args.samples} samples each of "
          f"{len(sources['eval'][0])} held-out prompts ...")
    # Held-out agreement is always measured on the target's own samples: what drafting will meet.
    records, held_out = gather("train", args.data), gather("eval")
    print(f"collected {len(records)} responses, {sum(len(r.tokens) - 1 for r in records)} pairs "
          f"(+{len(held_out)} held out) in {time.time() - start:.0f}s")
    before = acceptance_top1(drafter, held_out)
    accepted_before = accepted() if eval_strategy else None
    drafter, metrics = train_drafter(target, records, c, drafter)
    metrics.update(held_out_top1_before=round(before, 4), held_out_top1=round(acceptance_top1(drafter, held_out), 4))
    print(f"held-out top-1 agreement {before:.3f} -> {metrics['held_out_top1']:.3f}")
    if eval_strategy:
        metrics.update(held_out_strategy=eval_strategy, held_out_acceptance_before=accepted_before,
                       held_out_acceptance=accepted())
        print(f"held-out acceptance length ({eval_strategy}, the same samples before and after) "
              f"{accepted_before:.3f} -> {metrics['held_out_acceptance']:.3f}")
    drafter.config = dataclasses.replace(drafter.config, target_name=str(args.model))  # names its target
    drafter.save(args.out)
    data = {"model": args.model, "data": args.data, "from_drafter": args.from_drafter, "prompts": args.prompts,
            "samples": args.samples, "temperature": args.temperature, "max_tokens": args.max_tokens,
            "eval_prompts": args.eval_prompts, "task": args.task, "dataset": args.dataset, "eval_dataset": args.eval_dataset,
            "prompt_column": args.prompt_column, "completion_column": args.completion_column}
    atomic_write_json(Path(args.out) / "recipe.json",
                      {"command": command, "config": to_dict(c), "data": data, "metrics": metrics})
    print(f"wrote {args.out}")
    return 0
