"""`TrainConfig`: every knob of a GRPO run, flat so that each is one `key=value` on the command line.

The fields fall in five groups (model and data, rollout, loss, optimisation, run); `loss()` and
`engine()` hand the relevant ones to the component that owns them, whose own config validates again.
Defaults are the embedded default: the default model on the built-in task with adaptive speculation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tlt.adaptive.tuner import DEFAULT_ARMS
from tlt.errors import ConfigError
from tlt.model.checkpoint import DTYPE_NAMES


@dataclass(frozen=True)
class TrainConfig:
    # --- model and data
    model: str = "default"
    # The learned drafter for chain/tree speculation: a folder, a built-in one ("default", or
    # "references": trained on the task's reference solutions), "random" (a fresh one, learned online
    # while n-gram drafts serve), None (n-gram and off arms only) or "auto": the built-in drafter for
    # the built-in model, None for any other model.
    drafter: str | None = "auto"
    task: str = "arithmetic"  # built-in task, used unless `dataset` is given
    dataset: str | None = None  # a JSONL or Parquet file (verl or TRL layout)
    eval_dataset: str | None = None
    prompt_column: str = "prompt"
    reward: str = "arithmetic"  # a registered reward or an import path module:function
    reward_workers: int = 0  # 0: in-process; >= 1: a process pool with a per-call timeout
    reward_timeout_s: float = 30.0
    # A response counts as correct (accuracy, eval accuracy, pass@k) when its reward is >= this; the built-in
    # rewards give 1.0 for a right answer. Set it to what your reward gives a right answer.
    accuracy_threshold: float = 1.0
    # Stop the run when the reward failed (raised, hung, returned no finite number) on every row of this
    # many consecutive steps (0: never); a step with some rows scored costs only the failed rows.
    reward_failure_steps: int = 3
    train_problems: int = 20000  # problems drawn from the built-in task's train split
    # --- rollout
    prompts_per_step: int = 16
    group_size: int = 8
    max_response_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    speculative: str = "adaptive"  # off, on (one fixed `strategy`) or adaptive
    strategy: str | None = None
    max_batch_size: int = 256
    # The adaptive engine's tuner (tlt/adaptive/tuner.py): batch-size bucket bounds, arms (strategy
    # names, "off" among them), epsilon and how exploration draws are weighed ("cost" or "uniform").
    tuner_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tuner_arms: tuple[str, ...] = DEFAULT_ARMS
    tuner_epsilon: float = 0.1
    tuner_explore: str = "cost"
    # Pairs per row a drafting step after plain ones feeds the drafter, the newest (0: all); see
    # tlt/speculative/decoder.py.
    catch_up_window: int = 16
    # The history store (tlt/speculative/history.py) the suffix and hybrid arms draft from: per prompt the
    # last history_responses responses of earlier steps, history_mb in all (oldest evicted first),
    # none older than history_max_age policy versions (0: any), and the run's history_window most recent
    # responses to any prompt. Kept only when a suffix or hybrid arm can run; history_responses=0: never.
    history_responses: int = 8
    history_mb: int = 64
    history_max_age: int = 0
    history_window: int = 0
    # --- rollout workers and the adaptive drafter
    workers: int = 0  # rollout workers: 0 = one per core (a local Ray cluster; one per GPU, each holding one,
    # when the trainer runs on CUDA: a single GPU gives the in-process engine), 1 = in-process
    ray_address: str | None = None  # join this Ray cluster instead of starting a local one
    worker_threads: int = 0  # torch threads per worker (0: cores // workers, at least 1)
    worker_gpus: float = 0.0  # GPUs each Ray worker asks for (multi-node GPU clusters)
    drafter_train: str = "acceptance"  # off, every, every-N or acceptance (below a fraction of its best)
    drafter_train_every: int = 10  # for every-N
    drafter_train_fraction: float = 0.9  # for acceptance
    drafter_min_pairs: int = 2048  # buffered pairs before the first phase
    drafter_lr: float = 3e-4
    drafter_warmup_steps: int = 20  # over the run's first drafter optimizer steps (protects a trained drafter)
    drafter_batch_tokens: int = 2048
    drafter_window: int = 256
    drafter_unroll: int = 3  # training-time-test rounds of the drafter loss (one raised no tree acceptance online)
    drafter_max_steps: int = 0  # optimizer steps per spot phase at most (0: until rollout ends)
    drafter_local_steps: int = 8  # optimizer steps per phase in-process (workers=1: on the critical path)
    drafter_buffer_mb: int = 256
    drafter_buffer_steps: int = 2  # policy versions the online buffer keeps
    drafter_buffer_evict: str | None = None  # module:function, entries -> kept entries (None: the last steps)
    drafter_buffer_sample: str | None = None  # module:function, entries -> weights (None: by length)
    drafter_buffer_checkpoint: bool = True  # run checkpoints carry the online buffer: resume trains on the same data
    drafter_hot_swap_every: int = 0  # > 0: the spot trainer's drafter goes into tail workers every N optimizer steps
    # --- loss
    normalize_std: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: str = "token"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    filter_groups: bool = False  # drop groups whose rewards are all equal (they carry no signal)
    skip_zero_advantage: bool = True  # exact: such responses add nothing to the gradient (no KL/entropy)
    old_logprobs: str = "rollout"  # "rollout": the engine's; "recompute": a trainer forward before the update
    # > 0 (and old_logprobs=recompute): truncated importance sampling, each token's surrogate weighted by
    # min(pi_old / mu, tis_cap), mu the engine's probability of the token (a bf16 engine samples from a
    # slightly different distribution than the float32 trainer's pi_old); logged as tis_ratio, tis_clipped
    tis_cap: float = 0.0
    # --- optimisation
    lr: float = 1e-4
    lr_schedule: str = "constant"  # constant or cosine (to 10% of lr at `steps`)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    mini_batches: int = 1  # optimizer steps per rollout, each on a slice of the groups
    row_tokens: int = 256  # episodes are packed into rows this long (attention cost grows with its square)
    micro_batch_tokens: int = 4096  # tokens per micro-batch of rows (gradient accumulation over them)
    dtype: str = "float32"  # float32 or bfloat16 (autocast) for the trainer's forward; measure: on CPUs
    # without bf16 matrix units autocast is slower than float32
    # The rollout engines' weights: float32, bfloat16 or float16 (the trainer keeps float32 weights and
    # each sync casts them; the spot trainer trains a float32 twin of the engines' drafter). Not
    # float32 needs old_logprobs=recompute: the engine's log-probs are then not the trainer's.
    rollout_dtype: str = "float32"
    trainer_processes: int = 1  # > 1: the update runs data-parallel over this many processes (tlt.rl.distributed)
    # --- run
    steps: int = 60
    seed: int = 0
    eval_every: int = 10
    eval_problems: int = 128
    eval_samples: int = 4  # samples per eval problem at the training temperature (pass@k, k = eval_samples)
    save_every: int = 10
    keep_checkpoints: int = 2
    threads: int = 0
    # The trainer's policy (and reference) and the in-process engine: auto (the first CUDA device when
    # torch sees one, else the CPU), cpu, cuda or cuda:N. Ray workers take a GPU when they see one.
    device: str = "auto"
    tensorboard: bool = False
    wandb: bool = False  # scalars to Weights & Biases (WANDB_MODE=offline writes them locally only)
    wandb_project: str = "tlt"
    progress: bool | None = None

    def __post_init__(self) -> None:
        positive = ("train_problems", "prompts_per_step", "group_size", "max_response_tokens", "max_batch_size",
                    "mini_batches", "row_tokens", "micro_batch_tokens", "steps", "eval_problems", "eval_samples",
                    "keep_checkpoints", "trainer_processes")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"field {name!r} must be an integer >= 1, got {value!r}")
        for name in ("eval_every", "save_every", "warmup_steps", "reward_workers", "reward_failure_steps", "threads",
                     "workers",
                     "worker_threads", "drafter_train_every", "drafter_min_pairs", "drafter_max_steps",
                     "drafter_warmup_steps", "drafter_hot_swap_every",
                     "drafter_local_steps", "catch_up_window", "history_responses", "history_max_age",
                     "history_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"field {name!r} must be an integer >= 0, got {value!r}")
        choices = {"speculative": ("off", "on", "adaptive"), "old_logprobs": ("rollout", "recompute"),
                   "lr_schedule": ("constant", "cosine"), "dtype": ("float32", "bfloat16"),
                   "rollout_dtype": DTYPE_NAMES,
                   "aggregation": ("token", "sequence")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"field {name!r} must be one of {allowed}, got {getattr(self, name)!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ConfigError(f"field {f.name!r} must be a finite number, got {value!r}")
        ranges = (("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("top_k", isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "-1 (off) or >= 1"),
                  ("weight_decay", self.weight_decay >= 0, ">= 0"), ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"),
                  ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"), ("grad_clip", self.grad_clip > 0, "> 0"),
                  ("worker_gpus", self.worker_gpus >= 0, ">= 0"))
        for name, ok, expected in ranges:
            if not ok:
                raise ConfigError(f"field {name!r} must be {expected}, got {getattr(self, name)!r}")
        if self.group_size < 2:
            raise ConfigError(f"field 'group_size' must be >= 2 (GRPO compares samples of a group), got {self.group_size}")
        if self.mini_batches > self.prompts_per_step:
            raise ConfigError(f"field 'mini_batches' ({self.mini_batches}) must be <= prompts_per_step ({self.prompts_per_step})")
        if not self.temperature > 0:
            raise ConfigError(f"field 'temperature' must be > 0 for RL sampling, got {self.temperature}")
        if self.lr <= 0 or self.reward_timeout_s <= 0:
            raise ConfigError("fields 'lr' and 'reward_timeout_s' must be > 0")
        if not isinstance(self.wandb_project, str) or not self.wandb_project.strip():
            raise ConfigError(f"field 'wandb_project' must be a non-empty name, got {self.wandb_project!r}")
        if self.tis_cap > 0 and self.old_logprobs != "recompute":
            raise ConfigError(f"field 'tis_cap' is {self.tis_cap}: it needs old_logprobs=recompute (with the engine's "
                              "log-probs as pi_old, pi_old / mu is 1 and there is nothing to correct)")
        if self.rollout_dtype != "float32" and self.old_logprobs != "recompute":
            raise ConfigError(f"field 'rollout_dtype' is {self.rollout_dtype!r}: set old_logprobs=recompute, since the "
                              "engine's log-probs in that dtype are not the trainer's float32 ones")
        if self.speculative == "on" and not self.strategy:
            raise ConfigError("field 'strategy' is needed when speculative=on (e.g. tree-d6-k2-v16 or ngram-d4)")
        if self.speculative == "on":
            from tlt.speculative.strategy import Strategy

            try:
                strategy = Strategy.parse(self.strategy)
            except ConfigError as exc:
                raise ConfigError(f"field 'strategy' {self.strategy!r}: {exc}") from None
            if strategy.uses_drafter and self.rollout_drafter() is None:
                why = " (auto: there is no built-in drafter for this model)" if self.drafter == "auto" else ""
                raise ConfigError(f"field 'strategy' {self.strategy!r} drafts with a learned drafter, but drafter is "
                                  f"{self.drafter!r}{why}; give drafter=DIR (tlt train-drafter makes one) or "
                                  "drafter=random, or a model-free strategy such as ngram-d4")
        from tlt.device import check_device_name

        check_device_name(self.device, "field 'device'")
        self.spot()  # validates the drafter-training fields
        self.tuner()  # and the tuner's
        self.history()  # and the history store's
        self.loss()  # validates the loss fields

    def rollout_drafter(self) -> str | None:
        """The drafter the rollout engines use: None when speculation is off, "auto" resolved (the built-in
        drafter for the built-in model, none for any other)."""
        if self.speculative == "off":
            return None
        if self.drafter == "auto":
            return self.model if self.model in ("default", "bench") else None
        return self.drafter

    def spot(self):
        from tlt.spot.trainer import SpotConfig

        try:
            return SpotConfig(when=self.drafter_train, every=self.drafter_train_every,
                              fraction=self.drafter_train_fraction, min_pairs=self.drafter_min_pairs,
                              lr=self.drafter_lr, warmup_steps=self.drafter_warmup_steps,
                              batch_tokens=self.drafter_batch_tokens, rows=4,
                              window=self.drafter_window, unroll=self.drafter_unroll,
                              max_steps=self.drafter_max_steps,
                              buffer_mb=self.drafter_buffer_mb, buffer_versions=self.drafter_buffer_steps,
                              seed=self.seed)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (set through the TrainConfig fields drafter_*)") from None

    def history(self):
        """The history store's config, or None when nothing drafts from history: speculation off, no
        suffix or hybrid strategy among the arms (or as the strategy), or history_responses=0."""
        from tlt.speculative.history import HistoryConfig
        from tlt.speculative.strategy import Strategy

        if self.speculative == "off" or not self.history_responses:
            return None
        names = self.tuner_arms if self.speculative == "adaptive" else (self.strategy,)
        if not any(Strategy.parse(name).uses_history for name in names):
            return None
        if not isinstance(self.history_mb, int) or self.history_mb < 1:
            raise ConfigError(f"field 'history_mb' must be an integer >= 1, got {self.history_mb!r}")
        return HistoryConfig(responses_per_prompt=self.history_responses, max_bytes=self.history_mb << 20,
                             max_age=self.history_max_age, window=self.history_window)

    def tuner(self):
        from tlt.adaptive.tuner import TunerConfig

        try:
            return TunerConfig(buckets=self.tuner_buckets, arms=self.tuner_arms, epsilon=self.tuner_epsilon,
                               explore=self.tuner_explore)
        except ConfigError as exc:  # name the TrainConfig key, not the TunerConfig one
            raise ConfigError(str(exc).replace("TunerConfig field '", "field 'tuner_")) from None

    def loss(self):
        from tlt.rl.grpo import LossConfig

        return LossConfig(self.clip_low, self.clip_high, self.aggregation, self.kl_coef, self.entropy_coef, self.tis_cap)
