"""The GRPO trainer: one RL step is rollout -> reward -> advantages -> update -> sync.

  - rollout: the step's prompts (a deterministic function of the run seed and the step, so a resumed
    run draws the same ones) go to the rollout engine with one seed per prompt; each sample keeps its
    token ids and the log-probs of the warped distribution it was drawn from. The engine must hold the
    policy version the step expects, or it refuses to run.
  - reward: the reward function scores every completion with its example's columns.
  - advantages: group-relative (grpo.py); groups with all-equal rewards are optionally dropped.
  - update: `mini_batches` optimizer steps, each over packed micro-batches with gradient accumulation,
    on the clipped surrogate (plus k3 KL to a frozen reference and an entropy bonus when asked). The
    old log-probs are the engine's or recomputed by the trainer; both use the same warping as sampling,
    so the importance ratio starts at 1.
  - sync: the updated weights go into the engine with the next version number.
The trainer owns its policy copy in training mode; the engine owns an inference copy, as a remote
rollout worker would. Every step's time is split by stage, which is the point of tlt: the figure that
matters is the whole step, not a decoding micro-benchmark.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from tlt.data import Example
from tlt.errors import CheckpointError, ConfigError, TrainingError
from tlt.rl.config import TrainConfig
from tlt.rl.episode import Episode, MicroBatch, pack
from tlt.rl.grpo import entropy, group_advantages, policy_loss, token_weights, zero_variance_groups


def stream_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of parts, stable across processes (unlike the salted hash())."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class GRPOTrainer:
    def __init__(self, config: TrainConfig, run_dir: str | Path | None = None, log=print) -> None:
        from tlt.model import load_model
        from tlt.rewards.runner import RewardRunner
        from tlt.rollout import EngineConfig, RolloutEngine
        from tlt.tokenizer import load_tokenizer

        c = self.config = config
        self.run_dir, self.log = (Path(run_dir) if run_dir is not None else None), log
        if c.threads:
            torch.set_num_threads(c.threads)
        torch.manual_seed(c.seed)
        random.seed(c.seed)
        self.tokenizer = load_tokenizer(c.model)
        self.policy = load_model(c.model).train()
        self.reference = load_model(c.model).eval().requires_grad_(False) if c.kl_coef > 0 else None
        drafter = c.drafter if c.speculative != "off" else None
        if drafter == "auto":
            drafter = "default" if c.model == "default" else None
            if drafter is None:
                log(f"drafter=auto: no built-in drafter for {c.model}; speculating with n-gram drafts only "
                    "(train one with tlt train-drafter and pass drafter=DIR)")
        self.engine = RolloutEngine(load_model(c.model), self.tokenizer, EngineConfig(
            max_batch_size=c.max_batch_size, seed=c.seed, progress=c.progress, speculative=c.speculative,
            strategy=c.strategy, drafter=drafter))
        decay = [p for p in self.policy.parameters() if p.dim() >= 2]
        other = [p for p in self.policy.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": c.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=c.lr, betas=(c.beta1, c.beta2))
        self.reward = RewardRunner(c.reward, workers=c.reward_workers, timeout_s=c.reward_timeout_s)
        self.train_examples, self.eval_examples = self._load_data()
        self.step = 0  # optimizer updates done = the policy version the engine must hold
        self._orders: dict[int, list[int]] = {}
        self.engine.load_weights(self.policy.state_dict(), self.step)

    # --- data ------------------------------------------------------------------------------------------
    def _load_data(self) -> tuple[list[Example], list[Example]]:
        c = self.config
        if c.dataset:
            from tlt.data import load_examples

            train = load_examples(c.dataset, prompt_column=c.prompt_column)
            if c.eval_dataset:
                return train, load_examples(c.eval_dataset, prompt_column=c.prompt_column)[: c.eval_problems]
            # No eval file: hold out the dataset's last rows (at most a quarter of it), so that eval
            # accuracy is measured on prompts the policy never trains on.
            if not c.eval_every:
                return train, []
            held = min(c.eval_problems, len(train) // 4)
            if held < 1:
                raise ConfigError(f"{c.dataset}: {len(train)} examples are too few to hold any out for eval; "
                                  "give eval_dataset or set eval_every=0")
            self.log(f"eval on the last {held} of {len(train)} examples of {c.dataset}, held out of training")
            return train[:-held], train[-held:]
        from tlt.data import task_examples
        from tlt.tasks import get_task

        task = get_task(c.task)
        return task_examples(task, c.train_problems, c.seed, "train"), task_examples(task, c.eval_problems, c.seed, "eval")

    def examples_for_step(self, step: int) -> list[Example]:
        """The prompts of update `step` (0-based): consecutive slots of per-epoch shuffles of the data."""
        n, per = len(self.train_examples), self.config.prompts_per_step
        out = []
        for slot in range(step * per, (step + 1) * per):
            epoch, i = divmod(slot, n)
            if epoch not in self._orders:
                order = list(range(n))
                random.Random(stream_seed("order", self.config.seed, epoch)).shuffle(order)
                self._orders = {epoch: order}
            out.append(self.train_examples[self._orders[epoch][i]])
        return out

    def encode(self, prompt: str | list[dict]) -> list[int]:
        from tlt.chat import render_prompt

        return render_prompt(self.tokenizer, prompt)

    # --- the RL step -----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One RL step; returns its metrics. Advances `self.step` and the engine's policy version."""
        times: dict[str, float] = {}
        examples = self.examples_for_step(self.step)
        with _timer(times, "rollout"):
            episodes, rollout_stats = self.rollout(examples, self.step)
        with _timer(times, "reward"):
            self.score(episodes)
        rewards = torch.tensor([e.reward for e in episodes])
        groups = torch.tensor([e.group for e in episodes])
        for e, a in zip(episodes, group_advantages(rewards, groups, self.config.normalize_std).tolist()):
            e.advantage = a
        flat = zero_variance_groups(rewards, groups)
        learn = [e for e, f in zip(episodes, flat.tolist()) if not (self.config.filter_groups and f)]
        with _timer(times, "logprob"):
            old, ref = self.recomputed_logprobs(learn)
        with _timer(times, "update"):
            update = self.update(learn, old, ref) if learn else {"skipped_update": 1}
        with _timer(times, "sync"):
            self.step += 1
            self.engine.load_weights(self.policy.state_dict(), self.step)
        times["drafter"] = 0.0
        return self._metrics(episodes, rollout_stats, update, times, int(flat.sum()) // self.config.group_size)

    def rollout(self, examples: list[Example], step: int, greedy: bool = False, samples: int | None = None,
                salt: str = "train") -> tuple[list[Episode], dict]:
        from tlt.rollout import SamplingParams

        c = self.config
        prompts = [self.encode(ex.prompt) for ex in examples]
        for ex, ids in zip(examples, prompts):
            if not ids:  # e.g. a tokenizer whose vocabulary does not fit the class transformers loaded it as
                raise ConfigError(f"{ex.source}: the prompt encodes to no tokens with the tokenizer of {c.model} "
                                  f"({type(self.tokenizer).__name__}); check that the tokenizer matches the model")
        params = [SamplingParams(n=samples or c.group_size, temperature=0.0 if greedy else c.temperature,
                                 top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_response_tokens,
                                 seed=stream_seed(salt, c.seed, step, j)) for j in range(len(examples))]
        self.engine.reset_stats()
        outputs = self.engine.generate(prompts, params, weights_version=self.step)
        episodes = [
            Episode(j, ex, out.prompt_token_ids, comp.token_ids, comp.logprobs, comp.finish_reason,
                    self.tokenizer.decode(comp.token_ids), acceptance_length=comp.acceptance_length)
            for j, (ex, out) in enumerate(zip(examples, outputs)) for comp in out.outputs
        ]
        return episodes, self.engine.stats()

    def score(self, episodes: list[Episode]) -> None:
        keys = sorted({k for e in episodes for k in e.example.columns})
        columns = {k: [e.example.columns.get(k) for e in episodes] for k in keys}
        prompts = [e.example.prompt for e in episodes]
        result = self.reward.score(prompts, [e.text for e in episodes], columns, [e.example.source for e in episodes])
        for e, r, err in zip(episodes, result.rewards, result.errors):
            e.reward, e.reward_error = float(r), err
        for err in sorted({err for err in result.errors if err})[:3]:
            self.log(f"reward error (scored 0): {err}")

    # --- log-probs and the update ----------------------------------------------------------------------
    def _autocast(self):
        if self.config.dtype == "bfloat16":
            return torch.autocast(self.policy.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def token_logprobs(self, model, batch: MicroBatch, with_entropy: bool = False):
        """(log-probs [N], entropies [N] or None) of a micro-batch's response tokens under `model`, with
        the same temperature / top-k / top-p warping the engine sampled with."""
        from tlt.rollout.sampling import warp_logprobs

        c = self.config
        with self._autocast():
            out = model(batch.input_ids, position_ids=batch.position_ids, logit_index=batch.logit_index)
        logits = out.logits[batch.target_mask].float()  # [N, V]
        n = len(logits)
        logprobs = warp_logprobs(logits, torch.full((n,), c.temperature),
                                 torch.full((n,), c.top_k, dtype=torch.long), torch.full((n,), c.top_p))  # [N, V]
        tokens = batch.targets()  # [N]
        picked = logprobs.gather(1, tokens[:, None])[:, 0]  # [N]
        return picked, (entropy(logprobs) if with_entropy else None)

    def recomputed_logprobs(self, episodes: list[Episode]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Old log-probs recomputed by the trainer (when configured) and reference log-probs (with KL), per
        episode id(); an empty dict means "use the engine's" / "no reference"."""
        c = self.config
        old, ref = {}, {}
        if c.old_logprobs != "recompute" and self.reference is None:
            return old, ref
        with torch.no_grad():
            for mb in pack(episodes, c.row_tokens, c.micro_batch_tokens):
                spans = _spans(mb.episodes)
                if c.old_logprobs == "recompute":
                    lp, _ = self.token_logprobs(self.policy, mb)
                    old.update({id(e): lp[a:b] for e, (a, b) in zip(mb.episodes, spans)})
                if self.reference is not None:
                    lp, _ = self.token_logprobs(self.reference, mb)
                    ref.update({id(e): lp[a:b] for e, (a, b) in zip(mb.episodes, spans)})
        return old, ref

    def learning_rate(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if c.lr_schedule == "cosine":
            progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
            return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        return c.lr

    def update(self, episodes: list[Episode], old: dict, ref: dict) -> dict:
        c, loss_config = self.config, self.config.loss()
        groups = sorted({e.group for e in episodes})
        slices = [set(s.tolist()) for s in np.array_split(np.array(groups), min(c.mini_batches, len(groups)))]
        lr = self.learning_rate(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        totals = {"loss": 0.0, "ratio": 0.0, "clip_fraction": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0}
        first_dev = None
        # A response with advantage 0 adds exactly nothing to the surrogate's gradient; unless KL or
        # entropy terms touch it, it is left out of the forward but still counted in the normaliser,
        # so the update is unchanged and the many all-equal groups cost no compute.
        skip = c.skip_zero_advantage and loss_config.kl_coef == 0 and loss_config.entropy_coef == 0
        self.policy.train()
        ran = 0
        for members in slices:
            batch = [e for e in episodes if e.group in members]
            n_tokens = sum(len(e.completion_ids) for e in batch)
            active = [e for e in batch if e.advantage != 0.0] if skip else batch
            self.optimizer.zero_grad(set_to_none=True)
            seen, parts_sum = 0.0, {}
            for mb in pack(active, c.row_tokens, c.micro_batch_tokens):
                logp, ent = self.token_logprobs(self.policy, mb, with_entropy=True)
                lengths = torch.tensor([len(e.completion_ids) for e in mb.episodes])
                old_lp = torch.cat([old.get(id(e), torch.tensor(e.logprobs)) for e in mb.episodes])  # [N]
                ref_lp = torch.cat([ref[id(e)] for e in mb.episodes]) if ref else None
                adv = torch.tensor([e.advantage for e in mb.episodes]).repeat_interleave(lengths)  # [N]
                weights = token_weights(lengths, c.aggregation, n_tokens, len(batch))  # [N]
                loss, parts = policy_loss(logp, old_lp, adv, weights, loss_config, ref_lp, ent)
                if not torch.isfinite(loss):
                    raise TrainingError(self._diverged(f"the loss is {loss.item()}"))
                if first_dev is None:
                    first_dev = float((logp.detach() - old_lp).exp().sub(1).abs().max())
                loss.backward()
                totals["loss"] += loss.item() / len(slices)
                seen += float(weights.sum())
                for k, v in parts.items():
                    parts_sum[k] = parts_sum.get(k, 0.0) + v.item()
            # Diagnostics average over the responses that were run (all of them unless skipped).
            for k, v in parts_sum.items():
                totals[k] += v / seen / len(slices)
            ran += len(active)
            for p in self.policy.parameters():
                if p.grad is None:  # nothing was run: the same Adam step as an all-zero gradient
                    p.grad = torch.zeros_like(p)
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), c.grad_clip)
            if not torch.isfinite(norm):
                raise TrainingError(self._diverged(f"the gradient norm is {norm.item()}"))
            totals["grad_norm"] += norm.item() / len(slices)
            self.optimizer.step()
        if not ran:
            totals.update(ratio=None, clip_fraction=None, kl=None, entropy=None)
        return {**totals, "lr": lr, "ratio_first_max_dev": first_dev, "responses_in_update": ran}

    def _diverged(self, what: str) -> str:
        where = f"; the last good checkpoint in {self.run_dir} is kept (resume with tlt train --resume {self.run_dir})" \
            if self.run_dir is not None else ""
        return f"step {self.step + 1}: {what}, training stopped{where}"

    # --- eval and metrics ------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out accuracy (fraction of samples with reward >= 1): greedy, and sampled at the training
        temperature with pass@k over `eval_samples` samples. Seeds are fixed, so curves compare."""
        from tlt.evaluate import pass_at_k

        c = self.config
        if not self.eval_examples:
            return {}
        start = time.perf_counter()
        greedy, _ = self.rollout(self.eval_examples, 0, greedy=True, samples=1, salt="eval-greedy")
        sampled, _ = self.rollout(self.eval_examples, 0, samples=c.eval_samples, salt="eval")
        self.score(greedy)
        self.score(sampled)
        hits = np.array([e.reward >= 1.0 for e in sampled]).reshape(len(self.eval_examples), c.eval_samples)
        return {
            "eval_accuracy": float(hits.mean()),
            "eval_greedy_accuracy": float(np.mean([e.reward >= 1.0 for e in greedy])),
            f"eval_pass@{c.eval_samples}": float(np.mean([pass_at_k(c.eval_samples, int(h.sum()), c.eval_samples)
                                                          for h in hits])),
            "eval_response_length": float(np.mean([len(e.completion_ids) for e in sampled])),
            "eval_time_s": time.perf_counter() - start,
        }

    def _metrics(self, episodes: list[Episode], stats: dict, update: dict, times: dict, filtered: int) -> dict:
        lengths = np.array([len(e.completion_ids) for e in episodes])
        rewards = np.array([e.reward for e in episodes])
        tokens = int(lengths.sum())
        batch_sizes = stats["batch_sizes"]
        stride = max(1, math.ceil(len(batch_sizes) / 64))
        counts: dict[str, int] = {}
        by_batch: dict[str, dict[str, int]] = {}
        for size, s in zip(batch_sizes, stats["strategies"]):
            counts[s] = counts.get(s, 0) + 1
            by_batch.setdefault(str(size), {}).setdefault(s, 0)
            by_batch[str(size)][s] += 1
        return {
            "step": self.step,
            "reward": float(rewards.mean()),
            "accuracy": float((rewards >= 1.0).mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_p50": float(np.percentile(lengths, 50)),
            "response_length_p99": float(np.percentile(lengths, 99)),
            "response_length_max": int(lengths.max()),
            "truncated_fraction": float(np.mean([e.finish_reason == "length" for e in episodes])),
            "tokens": tokens,
            "tokens_per_s": tokens / max(times["rollout"], 1e-9),
            "acceptance_length": stats["acceptance_length"],
            "strategies": counts,
            "strategy_by_batch": by_batch,
            "response_lengths": lengths.tolist(),
            "live_batch": batch_sizes[::stride],
            "rollout_steps": len(batch_sizes),
            "groups_filtered": filtered,
            "reward_errors": sum(e.reward_error is not None for e in episodes),
            **update,
            **{f"time_{k}_s": v for k, v in times.items()},
            "time_step_s": sum(times.values()),
        }

    # --- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "data_position": self.step * self.config.prompts_per_step,
                "optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate()}

    def load_state_dict(self, state: dict, policy_state: dict, tuner_state: dict | None = None) -> None:
        missing, unexpected = self.policy.load_state_dict(policy_state, strict=False)
        tied = self.policy.config.tie_word_embeddings
        if unexpected or [k for k in missing if not (tied and k == "lm_head.weight")]:
            raise CheckpointError(f"checkpoint policy does not match the model: missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]}")
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if tuner_state is not None and self.engine.tuner is not None:
            self.engine.tuner.load_state_dict(tuner_state)
        self.step = int(state["step"])
        self.engine.load_weights(self.policy.state_dict(), self.step)

    def close(self) -> None:
        self.reward.close()


def _spans(episodes: list[Episode]) -> list[tuple[int, int]]:
    """(start, end) of each episode's response tokens within its micro-batch's flat target list."""
    out, start = [], 0
    for e in episodes:
        out.append((start, start + len(e.completion_ids)))
        start += len(e.completion_ids)
    return out


@contextlib.contextmanager
def _timer(times: dict[str, float], key: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - start

