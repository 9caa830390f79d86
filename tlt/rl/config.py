"""`TrainConfig`: every knob of a GRPO run, composed of one config per component.

Its own fields are the model and data, the rollout, the workers and the run; the components each hold
their group of keys and check them: `drafter` (SpotConfig: which drafter, and its online training),
`tuner` (TunerConfig: the adaptive engine's bandit), `history` (HistoryConfig: the store the suffix
arms draft from), `loss` (LossConfig: the GRPO objective), `optim` (OptimConfig: the policy's
optimiser), `eval` (EvalConfig: the held-out evals) and `log` (LogConfig: where scalars and progress
go). On the command line a group's key is dotted (`drafter.lr=1e-4`), in YAML nested
(`drafter: {lr: 1e-4}`); `tlt train --help-config` lists them all. Checks across components stay here.
Defaults are the embedded default: the default model on the built-in task with adaptive speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tlt.adaptive.tuner import TunerConfig
from tlt.config import check, check_choice, check_groups, check_int, check_numbers, group, setting
from tlt.errors import ConfigError, FieldError
from tlt.model.checkpoint import DTYPE_NAMES
from tlt.rl.grpo import LossConfig
from tlt.speculative.history import HistoryConfig
from tlt.spot.config import SpotConfig


@dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(1e-4, "learning rate (AdamW)")
    lr_schedule: str = setting("constant", "constant or cosine (to 10% of lr at `steps`)")
    warmup_steps: int = setting(0, "linear warm-up steps")
    weight_decay: float = setting(0.0, "AdamW weight decay, on matrices only")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.99, "AdamW beta2")
    grad_clip: float = setting(1.0, "gradient-norm clip")
    mini_batches: int = setting(1, "optimizer steps per rollout, each on a slice of the groups")
    row_tokens: int = setting(256, "episodes are packed into rows this long (attention cost grows with its square)")
    micro_batch_tokens: int = setting(4096, "tokens per micro-batch of rows (gradient accumulation over them)")

    def __post_init__(self) -> None:
        check_numbers(self)
        check(self, "lr", self.lr > 0, "> 0")
        check_choice(self, "lr_schedule", ("constant", "cosine"))
        check_int(self, "warmup_steps", 0)
        check(self, "weight_decay", self.weight_decay >= 0, ">= 0")
        for name in ("beta1", "beta2"):
            check(self, name, 0 <= getattr(self, name) < 1, "in [0, 1)")
        check(self, "grad_clip", self.grad_clip > 0, "> 0")
        for name in ("mini_batches", "row_tokens", "micro_batch_tokens"):
            check_int(self, name, 1)


@dataclass(frozen=True)
class EvalConfig:
    every: int = setting(10, "steps between evals (0: none)")
    problems: int = setting(128, "problems per eval, at most (a dataset without eval_dataset holds out its last "
                            "rows, at most a quarter)")
    samples: int = setting(4, "samples per eval problem at the training temperature (pass@k, k = eval.samples)")

    def __post_init__(self) -> None:
        check_int(self, "every", 0)
        for name in ("problems", "samples"):
            check_int(self, name, 1)


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = setting(False, "scalars to TensorBoard")
    wandb: bool = setting(False, "scalars to Weights & Biases (WANDB_MODE=offline writes them locally only)")
    wandb_project: str = setting("tlt", "the W&B project")
    progress: bool | None = setting(None, "a progress bar per rollout (none: when the console is a terminal)")

    def __post_init__(self) -> None:
        check(self, "wandb_project", isinstance(self.wandb_project, str) and bool(self.wandb_project.strip()),
              "a non-empty name")


def _previous_keys() -> dict[str, str]:
    """The flat keys of earlier releases, -> their dotted names."""
    drafter = ("train", "train_every", "train_fraction", "min_pairs", "lr", "warmup_steps", "batch_tokens", "window",
               "unroll", "max_steps", "local_steps", "buffer_mb", "buffer_steps", "buffer_evict", "buffer_sample",
               "buffer_checkpoint", "hot_swap_every")
    loss = ("normalize_std", "clip_low", "clip_high", "aggregation", "kl_coef", "entropy_coef", "filter_groups",
            "skip_zero_advantage", "old_logprobs", "tis_cap")
    optim = ("lr", "lr_schedule", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "mini_batches",
             "row_tokens", "micro_batch_tokens")
    return {"drafter": "drafter.model", "catch_up_window": "drafter.catch_up_window",
            **{f"drafter_{k}": f"drafter.{k}" for k in drafter},
            **{f"tuner_{k}": f"tuner.{k}" for k in ("buckets", "arms", "epsilon", "explore")},
            **{f"history_{k}": f"history.{k}" for k in ("responses", "mb", "max_age", "window")},
            **{k: f"loss.{k}" for k in loss},
            **{k: f"optim.{k}" for k in optim},
            **{f"eval_{k}": f"eval.{k}" for k in ("every", "problems", "samples")},
            **{k: f"log.{k}" for k in ("tensorboard", "wandb", "wandb_project", "progress")}}


@dataclass(frozen=True)
class TrainConfig:
    # Old keys set their new field with a FutureWarning (tlt/config.py reads this)
    RENAMED: ClassVar[dict[str, str]] = _previous_keys()

    # --- model and data
    model: str = setting("default", "the policy: a model folder or a built-in name (default, bench)")
    task: str = setting("arithmetic", "built-in task, used unless `dataset` is given")
    dataset: str | None = setting(None, "a JSONL or Parquet file (verl or TRL layout)")
    eval_dataset: str | None = setting(None, "held-out examples (none: the dataset's last rows, at most a quarter)")
    prompt_column: str = setting("prompt", "the dataset column holding the prompt")
    reward_columns: tuple[str, ...] = setting((), "dataset columns the reward gets under another name, COLUMN:NAME "
                                              "each (OpenRLHF's label for the math reward: label:ground_truth)")
    reward: str = setting("arithmetic", "a registered reward or an import path module:function")
    reward_workers: int = setting(0, "0: rewards in-process; >= 1: a process pool with a per-call timeout")
    reward_timeout_s: float = setting(30.0, "seconds a reward call may take in the pool (reward_workers >= 1; an "
                                      "in-process call has no limit)")
    accuracy_threshold: float = setting(1.0, "a response counts as correct (accuracy, pass@k) when its reward is >= "
                                        "this; the built-in rewards give 1.0 for a right answer")
    reward_failure_steps: int = setting(3, "stop when the reward failed on every row of this many consecutive steps "
                                        "(0: never)")
    train_problems: int = setting(20000, "problems drawn from the built-in task's train split")
    # --- rollout
    prompts_per_step: int = setting(16, "prompts per RL step")
    group_size: int = setting(8, "samples per prompt (GRPO compares them)")
    max_response_tokens: int = setting(512, "tokens per response at most")
    temperature: float = setting(1.0, "sampling temperature")
    top_p: float = setting(1.0, "nucleus sampling mass")
    top_k: int = setting(-1, "top-k sampling (-1: off)")
    speculative: str = setting("adaptive", "off, on (one fixed `strategy`) or adaptive (the tuner picks per step)")
    strategy: str | None = setting(None, "the strategy for speculative=on, e.g. tree-d6-k2-v16 or ngram-d4")
    max_batch_size: int = setting(256, "rows an engine decodes at once")
    # --- rollout workers
    # workers=0 with the trainer on CUDA: one per GPU, each holding one (a single GPU: the in-process engine)
    workers: int = setting(0, "rollout workers: 0 = one per core on a local Ray cluster, 1 = in-process")
    ray_address: str | None = setting(None, "join this Ray cluster instead of starting a local one")
    worker_threads: int = setting(0, "torch threads per worker (0: cores // workers, at least 1)")
    worker_gpus: float = setting(0.0, "GPUs each Ray worker asks for (multi-node GPU clusters)")
    # --- precision and the update's processes
    dtype: str = setting("float32", "float32 or bfloat16 (autocast) for the trainer's forward; on CPUs without bf16 "
                         "matrix units autocast is slower")
    rollout_dtype: str = setting("float32", "the engines' weights: float32, bfloat16 or float16 (not float32 needs "
                                 "loss.old_logprobs=recompute)")
    trainer_processes: int = setting(1, "> 1: the update runs data-parallel over this many processes")
    # --- run
    steps: int = setting(60, "RL steps (policy updates)")
    seed: int = setting(0, "seed of the prompts, the samples and the drafter's training")
    save_every: int = setting(10, "steps between checkpoints (0: none)")
    keep_checkpoints: int = setting(2, "checkpoints kept, the newest")
    threads: int = setting(0, "torch threads of the trainer (0: torch's default)")
    device: str = setting("auto", "the trainer's and the in-process engine's: auto (the first CUDA device, else the "
                          "CPU), cpu, cuda or cuda:N")
    # --- components
    drafter: SpotConfig = group(SpotConfig, "the learned drafter and its online training on released workers")
    tuner: TunerConfig = group(TunerConfig, "the adaptive engine's bandit (tlt/adaptive/tuner.py)")
    history: HistoryConfig = group(HistoryConfig, "earlier responses the suffix and hybrid arms draft from "
                                   "(tlt/speculative/history.py)")
    loss: LossConfig = group(LossConfig, "the GRPO objective (tlt/rl/grpo.py)")
    optim: OptimConfig = group(OptimConfig, "the policy's optimiser and the update's batching")
    eval: EvalConfig = group(EvalConfig, "held-out evals: how often, on how many problems, how many samples each")
    log: LogConfig = group(LogConfig, "where the run's scalars go besides metrics.jsonl, and the progress bar")

    def __post_init__(self) -> None:
        check_groups(self)
        check_numbers(self)
        for name in ("train_problems", "prompts_per_step", "max_response_tokens", "max_batch_size", "steps",
                     "keep_checkpoints", "trainer_processes"):
            check_int(self, name, 1)
        for name in ("reward_workers", "reward_failure_steps", "workers", "worker_threads", "save_every", "threads"):
            check_int(self, name, 0)
        check_int(self, "group_size")
        check(self, "group_size", self.group_size >= 2, ">= 2 (GRPO compares samples of a group)")
        # An empty value (`dataset=$DATA` with DATA unset) would otherwise mean the default or a missing folder.
        for name, expected in (("model", "a model folder or a built-in name"), ("prompt_column", "a column name"),
                               ("reward", "a registered reward or module:function"),
                               ("dataset", "a file path or none"), ("eval_dataset", "a file path or none")):
            value = getattr(self, name)
            check(self, name, not (isinstance(value, str) and not value.strip()), expected)
        from tlt.tasks import task_names

        check_choice(self, "task", tuple(task_names()))
        check_choice(self, "speculative", ("off", "on", "adaptive"))
        check_choice(self, "dtype", ("float32", "bfloat16"))
        check_choice(self, "rollout_dtype", DTYPE_NAMES)
        check(self, "reward_timeout_s", self.reward_timeout_s > 0, "> 0")
        check(self, "temperature", self.temperature > 0, "> 0 for RL sampling")
        check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        check(self, "top_k", isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "-1 (off) or >= 1")
        check(self, "worker_gpus", self.worker_gpus >= 0, ">= 0")
        from tlt.device import check_device_name

        check_device_name(self.device, "field 'device'")
        self.column_renames()
        self._check_across_components()

    def column_renames(self) -> dict[str, str]:
        """`reward_columns` as {dataset column: the reward's name for it}."""
        renames: dict[str, str] = {}
        if self.reward_columns and not self.dataset:
            raise FieldError("reward_columns", f"{list(self.reward_columns)} renames columns of a dataset file, and "
                                               "none is given (dataset=); the built-in task's columns are its own")
        for entry in self.reward_columns:
            column, sep, name = str(entry).partition(":")
            if not sep or not column or not name.isidentifier():
                raise FieldError("reward_columns", f"entry {entry!r} must be COLUMN:NAME with NAME a keyword the "
                                                   "reward can take (e.g. label:ground_truth)")
            if column == self.prompt_column:
                raise FieldError("reward_columns", f"entry {entry!r} renames the prompt column ({column!r})")
            if column in renames or name in renames.values():
                raise FieldError("reward_columns", f"entry {entry!r}: each column and each name once")
            renames[column] = name
        return renames

    def _check_across_components(self) -> None:
        if self.optim.mini_batches > self.prompts_per_step:
            raise FieldError("optim.mini_batches", f"({self.optim.mini_batches}) must be <= prompts_per_step "
                                                   f"({self.prompts_per_step})")
        recompute = self.loss.old_logprobs == "recompute"
        if self.loss.tis_cap > 0 and not recompute:
            raise FieldError("loss.tis_cap", f"is {self.loss.tis_cap}: it needs loss.old_logprobs=recompute (with the "
                                             "engine's log-probs as pi_old, pi_old / mu is 1 and there is nothing to "
                                             "correct)")
        if self.rollout_dtype != "float32" and not recompute:
            raise FieldError("rollout_dtype", f"is {self.rollout_dtype!r}: set loss.old_logprobs=recompute, since the "
                                              "engine's log-probs in that dtype are not the trainer's float32 ones")
        if self.speculative == "on":
            from tlt.speculative.strategy import Strategy

            if not self.strategy:
                raise FieldError("strategy", "is needed when speculative=on (e.g. tree-d6-k2-v16 or ngram-d4)")
            try:
                strategy = Strategy.parse(self.strategy)
            except ConfigError as exc:
                raise FieldError("strategy", f"{self.strategy!r}: {exc}") from None
            if strategy.uses_drafter and self.rollout_drafter() is None:
                model = self.drafter.model
                why = " (auto: there is no built-in drafter for this model)" if model == "auto" else ""
                raise FieldError("strategy", f"{self.strategy!r} drafts with a learned drafter, but drafter.model is "
                                             f"{model!r}{why}; give drafter.model=DIR (tlt train-drafter makes one) or "
                                             "drafter.model=random, or a model-free strategy such as ngram-d4")

    def rollout_drafter(self) -> str | None:
        """The drafter the rollout engines use: None when speculation is off, "auto" resolved (the built-in
        drafter for the built-in model, none for any other)."""
        if self.speculative == "off":
            return None
        if self.drafter.model == "auto":
            return self.model if self.model in ("default", "bench") else None
        return self.drafter.model

    def drafts_from_history(self) -> bool:
        """Whether the run keeps a history store: speculation on, a suffix or hybrid strategy among the arms
        (or as the strategy), and history.responses > 0."""
        from tlt.speculative.strategy import Strategy

        if self.speculative == "off" or not self.history.responses:
            return False
        names = self.tuner.arms if self.speculative == "adaptive" else (self.strategy,)
        return any(Strategy.parse(name).uses_history for name in names)
