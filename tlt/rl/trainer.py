"""The GRPO trainer: one RL step is rollout -> reward -> advantages -> update -> sync.

  - rollout: the step's prompts (a deterministic function of the run seed and the step, so a resumed
    run draws the same ones) go to the rollout engine with one seed per prompt; each sample keeps its
    token ids and the log-probs of the warped distribution it was drawn from. The engine must hold the
    policy version the step expects, or it refuses to run.
  - reward: the reward function scores every completion with its example's columns.
  - advantages: group-relative (grpo.py); groups with all-equal rewards are optionally dropped.
  - update: `optim.mini_batches` optimizer steps, each over packed micro-batches with gradient accumulation,
    on the clipped surrogate (plus k3 KL to a frozen reference and an entropy bonus when asked). The
    old log-probs are the engine's or recomputed by the trainer; both use the same warping as sampling,
    so the importance ratio starts at 1 (update.py). With `trainer_processes` > 1 it runs
    data-parallel over that many processes, this one rank 0 (distributed.py).
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
import warnings
from pathlib import Path

import numpy as np
import torch

from tlt.data import Example
from tlt.device import resolve_device, slow_cpu_bf16
from tlt.errors import CheckpointError, ConfigError, TrainingError
from tlt.rl.checkpoint import TrainerState
from tlt.rl.config import TrainConfig
from tlt.rl.distributed import Replicas
from tlt.rl.episode import Episode, MicroBatch
from tlt.rl.grpo import group_advantages, zero_variance_groups
from tlt.rl.update import Diverged, Sample, build_optimizer, token_logprobs, update_policy, update_slices
from tlt.rollout.stats import RolloutStats
from tlt.speculative.history import HistoryStore
from tlt.spot.rollout import RolloutReport, drafter_acceptance, make_rollout
from tlt.spot.trainer import PhaseReport


def stream_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of parts, stable across processes (unlike the salted hash())."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class GRPOTrainer:
    def __init__(self, config: TrainConfig, run_dir: str | Path | None = None, log=print) -> None:
        from tlt.model import load_model
        from tlt.model.checkpoint import load_config
        from tlt.rewards.runner import RewardRunner
        from tlt.tokenizer import load_tokenizer

        c = self.config = config
        self.run_dir, self.log = (Path(run_dir) if run_dir is not None else None), log
        if c.threads:
            torch.set_num_threads(c.threads)
        torch.manual_seed(c.seed)
        random.seed(c.seed)
        # What can be checked without weights goes first: a bad model config, dataset row, prompt or
        # reward fails before any model loads or any helper process starts.
        model_config = load_config(c.model)
        self.context_length = model_config.max_position_embeddings
        self._check_named_settings(model_config)
        self.tokenizer = load_tokenizer(c.model)
        self.train_examples, self.eval_examples = self._load_data()
        self._prompt_ids: dict[int, list[int]] = {}
        self._prompt_ids = self._encode_all([*self.train_examples, *self.eval_examples])
        self._check_reward()
        self.device = resolve_device(c.device, "field 'device'")
        if self.device.type == "cpu" and "bfloat16" in (c.dtype, c.rollout_dtype) and slow_cpu_bf16():
            warnings.warn("tlt: bfloat16 (fields 'dtype' / 'rollout_dtype') on a CPU without bf16 products "
                          "(oneDNN has none here) runs several times slower than float32 (the default): 44x for "
                          "an autocast forward and backward on a Zen 3 EPYC", RuntimeWarning, stacklevel=2)
        self.policy = load_model(c.model, device=self.device).train()
        self.reference = (load_model(c.model, device=self.device).eval().requires_grad_(False)
                          if c.loss.kl_coef > 0 else None)
        self.optimizer = build_optimizer(self.policy, c.optim)
        self.step = 0  # optimizer updates done = the policy version the engine must hold
        self._orders: dict[int, list[int]] = {}
        self.reward_failed_steps = 0  # consecutive steps whose every reward call failed
        # Earlier responses per prompt, the suffix drafter's source (None unless a suffix arm can run)
        self.history = HistoryStore(c.history) if c.drafts_from_history() else None
        self.reward = RewardRunner(c.reward, workers=c.reward_workers, timeout_s=c.reward_timeout_s)
        self.rollout_backend = self.replicas = None
        try:
            self.rollout_backend = make_rollout(c, self.policy, self.tokenizer, self.device, self.run_dir, log)
            self.engine = self.rollout_backend.engine  # the in-process engine (None on a Ray pool)
            self.rollout_backend.load_weights(self.policy.state_dict(), self.step)
            self.replicas = Replicas(c, self.policy, self.optimizer) if c.trainer_processes > 1 else None
        except BaseException:
            self.close()
            raise

    def _check_named_settings(self, model_config) -> None:
        """The settings that name something outside the config (the drafter folder, buffer policies by
        import path), checked against the model's config.json before any weights load."""
        from types import SimpleNamespace

        from tlt.config import import_callable
        from tlt.model.checkpoint import read_json
        from tlt.speculative.drafter import BUILTIN_DRAFTERS, DrafterConfig, drafter_folder

        c = self.config
        drafter = c.rollout_drafter()
        if drafter not in (None, "random"):
            folder = drafter_folder(drafter)
            if not folder.is_dir():
                raise ConfigError(f"field 'drafter.model' {drafter!r}: no such folder (expected a drafter folder holding "
                                  f"drafter_config.json, one of {sorted(BUILTIN_DRAFTERS)}, random or none)")
            path = folder / "drafter_config.json"
            if not path.is_file():
                policy = (folder / "config.json").is_file()
                raise ConfigError(f"field 'drafter.model' {drafter!r}: the folder has no drafter_config.json"
                                  f"{' (it holds a model: a policy, not a drafter)' if policy else ''}; give a drafter "
                                  "folder (tlt train-drafter writes one), random or none")
            raw = read_json(path)
            try:
                config = DrafterConfig(**{**raw, "feature_layers": tuple(raw["feature_layers"])
                                          if raw.get("feature_layers") is not None else None})
            except TypeError as exc:
                raise CheckpointError(f"{path}: {exc}") from None
            config.check_target(SimpleNamespace(config=model_config), f"{path} (field 'drafter.model')")
        if drafter is not None and c.drafter.train != "off":
            for name in ("buffer_evict", "buffer_sample"):
                if getattr(c.drafter, name):
                    import_callable(getattr(c.drafter, name), f"field 'drafter.{name}'")

    def _check_reward(self) -> None:
        """The reward's import and its parameters against the columns of the rows it scores (a required
        parameter no row has would fail every row from the first step), and a warning when
        reward_timeout_s is changed but cannot apply: in-process calls (reward_workers=0) have no limit."""
        from tlt.rewards.registry import check_columns, get_reward

        c = self.config
        fn = get_reward(c.reward)
        scored = [(self.train_examples, c.dataset or f"the built-in task {c.task!r}")]
        if c.eval_dataset:  # (evaluated at eval.every, and by side-by-side runs at their start and end)
            scored.append((self.eval_examples, c.eval_dataset))
        for examples, where in scored:
            check_columns(fn, c.reward, {k for ex in examples for k in ex.columns}, where)
        if not c.reward_workers and c.reward_timeout_s != TrainConfig.reward_timeout_s:
            self.log(f"warning: reward_timeout_s={c.reward_timeout_s:g} has no effect with reward_workers=0: the "
                     "reward runs in the training process, where a call that hangs cannot be stopped; set "
                     "reward_workers=1 or more to limit each call to reward_timeout_s seconds")

    # --- data ------------------------------------------------------------------------------------------
    def _load_data(self) -> tuple[list[Example], list[Example]]:
        c = self.config
        if c.dataset:
            from tlt.data import load_examples

            renames = c.column_renames()
            train = load_examples(c.dataset, prompt_column=c.prompt_column, columns=renames)
            if c.eval_dataset:
                held = load_examples(c.eval_dataset, prompt_column=c.prompt_column, columns=renames,
                                     name="eval_dataset")
                if len(held) > c.eval.problems:
                    self.log(f"eval on the first {c.eval.problems} of {len(held)} examples of {c.eval_dataset} "
                             f"(eval.problems={c.eval.problems})")
                held = held[: c.eval.problems]
                self._check_eval_columns(train, held)
                return train, held
            # No eval file: hold out the dataset's last rows (at most a quarter of it), so that eval
            # accuracy is measured on prompts the policy never trains on.
            if not c.eval.every:
                return train, []
            held = min(c.eval.problems, len(train) // 4)
            if held < 1:
                raise ConfigError(f"{c.dataset}: {len(train)} examples are too few to hold any out for eval; "
                                  "give eval_dataset or set eval.every=0")
            self.log(f"eval on the last {held} of {len(train)} examples of {c.dataset}, held out of training")
            return train[:-held], train[-held:]
        from tlt.data import task_examples
        from tlt.tasks import get_task

        task = get_task(c.task)
        return task_examples(task, c.train_problems, c.seed, "train"), task_examples(task, c.eval.problems, c.seed, "eval")

    def _check_eval_columns(self, train: list[Example], held: list[Example]) -> None:
        """Warn when eval rows lack a column that every training row has: the reward would then be called
        without it in eval (None, or no such keyword), and fail or score those rows differently."""
        c = self.config
        everywhere = set.intersection(*(set(ex.columns) for ex in train))
        lacking = sorted(everywhere - set.intersection(*(set(ex.columns) for ex in held)))
        if lacking:
            where = next(ex.source for ex in held if not everywhere <= set(ex.columns))
            self.log(f"warning: eval_dataset {c.eval_dataset} lacks the column(s) {lacking} that every row of "
                     f"{c.dataset} has (first: {where}); the reward {c.reward!r} gets no value for them in eval")

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

    def encode(self, example: Example) -> list[int]:
        """The prompt's token ids (encoded once; errors name the example's source)."""
        from tlt.chat import render_prompt

        ids = self._prompt_ids.get(id(example))
        if ids is not None:
            return ids
        try:
            ids = render_prompt(self.tokenizer, example.prompt)
        except ConfigError as exc:
            raise ConfigError(f"{example.source}: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:  # e.g. a character the built-in tokenizer lacks
            raise ConfigError(f"{example.source}: the prompt cannot be encoded with the tokenizer of "
                              f"{self.config.model} ({exc})") from None
        if not ids:  # e.g. a tokenizer whose vocabulary does not fit the class transformers loaded it as
            raise ConfigError(f"{example.source}: the prompt encodes to no tokens with the tokenizer of "
                              f"{self.config.model} ({type(self.tokenizer).__name__}); check that the tokenizer "
                              "matches the model")
        if len(ids) >= self.context_length:
            raise ConfigError(f"{example.source}: the prompt has {len(ids)} tokens; the model's context "
                              f"(max_position_embeddings of {self.config.model}) is {self.context_length}, "
                              "leaving no room to generate; shorten or drop this row")
        return ids

    def _encode_all(self, examples: list[Example]) -> dict[int, list[int]]:
        """Every training and eval prompt's ids by id() of its example, checked at start so that a prompt
        that cannot run is named by its row now rather than steps into the run. A prompt that leaves less
        than max_response_tokens of context is allowed: its responses stop at the context (finish reason
        "length"), as the engine does for any request; the count is logged."""
        out = {id(ex): self.encode(ex) for ex in examples}
        room = self.context_length - self.config.max_response_tokens
        short = [ex for ex in examples if len(out[id(ex)]) > room]
        if short:
            worst = max(short, key=lambda ex: len(out[id(ex)]))
            self.log(f"warning: {len(short)} of {len(examples)} prompts leave less than max_response_tokens="
                     f"{self.config.max_response_tokens} of the model's context ({self.context_length}); their "
                     f"responses stop at the context (longest: {worst.source}, {len(out[id(worst)])} tokens)")
        return out

    # --- the RL step -----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One RL step; returns its metrics. Advances `self.step` and the engine's policy version."""
        times: dict[str, float] = {}
        examples = self.examples_for_step(self.step)
        with _timer(times, "rollout"):
            episodes, report = self.rollout(examples, self.step)
        with _timer(times, "reward"):
            result = self.score(episodes)
        self._check_reward_failures(result)
        rewards = torch.tensor([e.reward for e in episodes])
        groups = torch.tensor([e.group for e in episodes])
        for e, a in zip(episodes, group_advantages(rewards, groups, self.config.loss.normalize_std).tolist()):
            e.advantage = a
        flat = zero_variance_groups(rewards, groups)
        learn = [e for e, f in zip(episodes, flat.tolist()) if not (self.config.loss.filter_groups and f)]
        with _timer(times, "logprob"):
            old, ref = self.recomputed_logprobs(learn)
        with _timer(times, "update"):
            update = self.update(learn, old, ref) if learn else {"skipped_update": 1}
        with _timer(times, "sync"):
            self.step += 1
            self.rollout_backend.load_weights(self.policy.state_dict(), self.step)
        with _timer(times, "drafter"):
            phase = self.rollout_backend.finish_step(self.step - 1)
        metrics = self._metrics(episodes, report.stats, update, times, int(flat.sum()) // self.config.group_size)
        return {**metrics, **self._drafter_metrics(report, phase)}

    def _check_reward_failures(self, result) -> None:
        """Stop the run when the reward failed on every row of `reward_failure_steps` consecutive steps:
        such steps learn nothing, and the cause (a bug, a missing column, a dead service) will not mend
        itself. Raised before the update, so the step is not applied."""
        c = self.config
        all_failed = bool(result.errors) and all(err is not None for err in result.errors)
        self.reward_failed_steps = self.reward_failed_steps + 1 if all_failed else 0
        if c.reward_failure_steps and self.reward_failed_steps >= c.reward_failure_steps:
            raise TrainingError(self._diverged(
                f"the reward {c.reward!r} failed on every row of {self.reward_failed_steps} consecutive steps "
                f"(reward_failure_steps={c.reward_failure_steps}); the last failure: {result.failures[-1]}"))

    def _drafter_metrics(self, report: RolloutReport, phase: PhaseReport | None) -> dict:
        """The drafter's side of a step: acceptance of the learned drafter's steps, the spot phase
        (DrafterLearning.metrics), the workers' time split and the history store's figures."""
        learning, stats = self.rollout_backend.learning, report.stats
        out = {"drafter_acceptance_length": drafter_acceptance(stats),
               "acceptance_by_strategy": stats.acceptance_by_strategy(), "rows_by_strategy": stats.rows_by_strategy(),
               "drafted_by_strategy": stats.drafted_per_row_step()}
        if learning is not None:
            out.update(learning.metrics(phase))
        if report.pool is not None:
            out["workers"] = report.pool.as_dict()
        if stats.sources:
            out["draft_sources"] = {k: list(v) for k, v in stats.sources.items()}
        if self.history is not None:
            out.update(self.history.stats())
        return out

    def rollout(self, examples: list[Example], step: int, greedy: bool = False, samples: int | None = None,
                salt: str = "train") -> tuple[list[Episode], RolloutReport]:
        from tlt.rollout import SamplingParams

        c = self.config
        prompts = [self.encode(ex) for ex in examples]
        params = [SamplingParams(n=samples or c.group_size, temperature=0.0 if greedy else c.temperature,
                                 top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_response_tokens,
                                 seed=stream_seed(salt, c.seed, step, j)) for j in range(len(examples))]
        # eval runs on the same engines, but the drafter does not learn from held-out prompts, and the
        # history keeps training responses only
        learn = salt == "train"
        history = self.history if learn else None
        drafts = {"history": history.drafts(prompts, self.step)} if history is not None else {}
        outputs, report = self.rollout_backend.generate(prompts, params, self.step, step, learn=learn, **drafts)
        if history is not None:
            for ids, out in zip(prompts, outputs):
                history.add(ids, [comp.token_ids for comp in out.outputs], self.step)
        episodes = [
            Episode(j, ex, out.prompt_token_ids, comp.token_ids, comp.logprobs, comp.finish_reason,
                    self.tokenizer.decode(comp.token_ids), acceptance_length=comp.acceptance_length)
            for j, (ex, out) in enumerate(zip(examples, outputs)) for comp in out.outputs
        ]
        return episodes, report

    def score(self, episodes: list[Episode]) -> None:
        keys = sorted({k for e in episodes for k in e.example.columns})
        columns = {k: [e.example.columns.get(k) for e in episodes] for k in keys}
        prompts = [e.example.prompt for e in episodes]
        result = self.reward.score(prompts, [e.text for e in episodes], columns, [e.example.source for e in episodes])
        for e, r, err in zip(episodes, result.rewards, result.errors):
            e.reward, e.reward_error = float(r), err
        failed = sum(err is not None for err in result.errors)
        if failed:
            more = f" ({len(result.failures) - 3} more failures)" if len(result.failures) > 3 else ""
            self.log(f"reward errors: {failed} of {len(episodes)} rows scored 0{more}")
            for failure in result.failures[:3]:
                self.log(f"  {failure}")
        return result

    # --- log-probs and the update ----------------------------------------------------------------------
    def token_logprobs(self, model, batch: MicroBatch, with_entropy: bool = False):
        """(log-probs [N], entropies [N] or None) of a micro-batch's response tokens under `model`, with
        the same temperature / top-k / top-p warping the engine sampled with."""
        return token_logprobs(model, batch, self.config, with_entropy)

    def recomputed_logprobs(self, episodes: list[Episode]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Old log-probs recomputed by the trainer (when configured) and reference log-probs (with KL), per
        episode id() of the responses the update's forward runs; an empty dict means "use the engine's" /
        "no reference"."""
        c = self.config
        old, ref = {}, {}
        recompute = c.loss.old_logprobs == "recompute"
        if not recompute and self.reference is None:
            return old, ref
        with torch.no_grad():
            # The update's own micro-batches: the responses its forward runs, packed as it packs them.
            for mb in (mb for _, _, micro_batches in update_slices(episodes, c) for mb in micro_batches):
                spans = _spans(mb.episodes)
                if recompute:
                    lp, _ = self.token_logprobs(self.policy, mb)
                    old.update({id(e): lp[a:b] for e, (a, b) in zip(mb.episodes, spans)})
                if self.reference is not None:
                    lp, _ = self.token_logprobs(self.reference, mb)
                    ref.update({id(e): lp[a:b] for e, (a, b) in zip(mb.episodes, spans)})
        return old, ref

    def learning_rate(self, step: int) -> float:
        c, steps = self.config.optim, self.config.steps
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if c.lr_schedule == "cosine":
            progress = (step - c.warmup_steps) / max(1, steps - c.warmup_steps)
            return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        return c.lr

    def update(self, episodes: list[Episode], old: dict, ref: dict) -> dict:
        """The optimizer steps of one RL step (update.update_policy), over every trainer process."""
        recomputed = self.config.loss.old_logprobs == "recompute"
        samples = [Sample.of(e, old, ref, recomputed) for e in episodes]
        lr = self.learning_rate(self.step)
        try:
            if self.replicas is None:
                return update_policy(self.policy, self.optimizer, self.config, samples, lr)
            return self.replicas.update(self.policy, self.optimizer, samples, lr)
        except Diverged as exc:
            raise TrainingError(self._diverged(str(exc))) from None

    def _diverged(self, what: str) -> str:
        where = f"; the last good checkpoint in {self.run_dir} is kept (resume with tlt train --resume {self.run_dir})" \
            if self.run_dir is not None else ""
        return f"step {self.step + 1}: {what}, training stopped{where}"

    # --- eval and metrics ------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out accuracy (fraction of samples with reward >= accuracy_threshold): greedy, and sampled at
        the training temperature with pass@k over `eval.samples` samples. Seeds are fixed, so curves compare."""
        from tlt.evaluate import pass_at_k

        c = self.config
        if not self.eval_examples:
            return {}
        start = time.perf_counter()
        greedy, _ = self.rollout(self.eval_examples, 0, greedy=True, samples=1, salt="eval-greedy")
        sampled, _ = self.rollout(self.eval_examples, 0, samples=c.eval.samples, salt="eval")
        self.score(greedy)
        self.score(sampled)
        hits = np.array([e.reward >= c.accuracy_threshold for e in sampled]).reshape(len(self.eval_examples), c.eval.samples)
        return {
            "eval_accuracy": float(hits.mean()),
            "eval_greedy_accuracy": float(np.mean([e.reward >= c.accuracy_threshold for e in greedy])),
            f"eval_pass@{c.eval.samples}": float(np.mean([pass_at_k(c.eval.samples, int(h.sum()), c.eval.samples)
                                                          for h in hits])),
            "eval_response_length": float(np.mean([len(e.completion_ids) for e in sampled])),
            "eval_time_s": time.perf_counter() - start,
        }

    def _metrics(self, episodes: list[Episode], stats: RolloutStats, update: dict, times: dict, filtered: int) -> dict:
        lengths = np.array([len(e.completion_ids) for e in episodes])
        rewards = np.array([e.reward for e in episodes])
        tokens = int(lengths.sum())
        batch_sizes = stats.batch_sizes
        stride = max(1, math.ceil(len(batch_sizes) / 64))
        counts: dict[str, int] = {}
        by_batch: dict[str, dict[str, int]] = {}
        seconds_by_batch: dict[str, dict[str, float]] = {}  # batch size -> strategy -> decode seconds
        tokens_by_batch: dict[str, dict[str, int]] = {}  # batch size -> strategy -> tokens emitted
        for size, s, seconds, emitted in zip(batch_sizes, stats.strategies, stats.step_times, stats.step_tokens):
            counts[s] = counts.get(s, 0) + 1
            for table, value in ((by_batch, 1), (seconds_by_batch, seconds), (tokens_by_batch, emitted)):
                slot = table.setdefault(str(size), {})
                slot[s] = slot.get(s, 0) + value
        return {
            "step": self.step,
            "reward": float(rewards.mean()),
            "accuracy": float((rewards >= self.config.accuracy_threshold).mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_p50": float(np.percentile(lengths, 50)),
            "response_length_p99": float(np.percentile(lengths, 99)),
            "response_length_max": int(lengths.max()),
            "truncated_fraction": float(np.mean([e.finish_reason == "length" for e in episodes])),
            "tokens": tokens,
            "tokens_per_s": tokens / max(times["rollout"], 1e-9),
            "acceptance_length": stats.acceptance_length(),
            "strategies": counts,
            "strategy_by_batch": by_batch,
            "tokens_by_batch": tokens_by_batch,
            "time_decode_by_batch_s": seconds_by_batch,
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
    def state(self) -> TrainerState:
        """The trainer's own state for a checkpoint."""
        learning = self.rollout_backend.learning
        return TrainerState(self.step, self.step * self.config.prompts_per_step, self.optimizer.state_dict(),
                            torch.get_rng_state(), random.getstate(),
                            learning.schedule.state_dict() if learning is not None else None,
                            self.history.state_dict() if self.history is not None else None)

    def restore(self, saved) -> None:
        """Continue from a checkpoint read by `tlt.rl.checkpoint.read_checkpoint`. What can still fail
        (the policy's names and shapes, the online buffer's files, the drafting states' fields) is checked
        first, so after a CheckpointError the caller can restore an older checkpoint over it. Weights of
        other names or shapes than the model's raise ConfigError instead: the run was resumed with another
        `model`, which no older checkpoint of the run mends."""
        learning = self.rollout_backend.learning
        own = self.policy.state_dict()
        tied = self.policy.config.tie_word_embeddings
        missing = [k for k in own if k not in saved.policy and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in saved.policy if k not in own]
        wrong = [f"{k} {tuple(saved.policy[k].shape)} vs {tuple(own[k].shape)}" for k in saved.policy
                 if k in own and saved.policy[k].shape != own[k].shape]
        if missing or unexpected or wrong:
            found = "; ".join(f"{what} {names[:3]}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                              for what, names in (("missing", missing), ("unexpected", unexpected),
                                                  ("other shape (saved vs model)", wrong)) if names)
            raise ConfigError(f"{saved.folder / 'policy'}: the run's weights do not fit model={self.config.model} "
                              f"({found}); resume with the model the run was started with, or start a new run "
                              "with --out")
        if saved.buffer is not None:
            if learning is None:
                self.log(f"{saved.buffer}: the run is resumed without drafter training; its online buffer is not loaded")
            else:
                learning.buffer.load(saved.buffer)
        if saved.drafting is not None:
            try:
                self.rollout_backend.load_drafting_states(saved.drafting)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                raise CheckpointError(f"{saved.drafting_file}: not a drafting state ({type(exc).__name__}: "
                                      f"{exc})") from None
        self.policy.load_state_dict(saved.policy, strict=False)
        state = saved.state
        self.optimizer.load_state_dict(state.optimizer)
        if self.replicas is not None:  # rank 0's state is the one saved; the helpers take it
            self.replicas.sync(self.policy, self.optimizer)
        torch.set_rng_state(state.torch_rng)
        random.setstate(state.python_rng)
        if learning is not None and state.drafter_schedule is not None:
            learning.schedule.load_state_dict(state.drafter_schedule)
        if self.history is not None and state.history is not None:
            self.history.load_state_dict(state.history)
        if saved.drafter is not None:
            if learning is None:
                self.log(f"{saved.folder / 'drafter'}: the run is resumed without drafter training; "
                         "its trained drafter is not loaded")
            else:
                self.rollout_backend.restore_drafter(saved.drafter)
        self.step = state.step
        self.rollout_backend.load_weights(self.policy.state_dict(), self.step)

    def drafter_snapshot(self):
        """The drafter trainer's newest state as something `save_checkpoint` can save (None: none yet)."""
        learning = self.rollout_backend.learning
        return learning.snapshot(self.step) if learning is not None else None

    def drafter_buffer(self):
        """The online buffer to save with a checkpoint (None: no drafter training, or not asked)."""
        learning = self.rollout_backend.learning
        return learning.buffer if learning is not None and self.config.drafter.buffer_checkpoint else None

    def drafting_states(self) -> list[dict | None]:
        """The rollout side's state for a checkpoint: every worker's drafting state (None: it has none)."""
        return self.rollout_backend.drafting_states()

    def close(self) -> None:
        self.reward.close()
        if self.rollout_backend is not None:
            self.rollout_backend.close()
        if self.replicas is not None:
            self.replicas.close()


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

