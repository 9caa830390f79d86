"""`SpotConfig`: the drafter a GRPO run speculates with and how it learns online (the `drafter.*` keys).

`model` picks the drafter; the rest is its online ("spot") training on released rollout workers: when a
phase runs (`Schedule`, spot/schedule.py), the drafter's optimisation, the online buffer it trains on
(spot/buffer.py) and how new weights reach the workers. The phase's seed is the run's, not a field here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlt.config import check, check_choice, check_int, check_numbers, setting

WHEN = ("off", "every", "every-N", "acceptance")


@dataclass(frozen=True)
class SpotConfig:
    # references: trained on the task's reference solutions; random: learned online while n-gram drafts serve
    model: str | None = setting("auto", "the learned drafter: a folder, default, references, random, none (n-gram "
                                "and off arms only) or auto (the built-in one for the built-in model, else none)")
    train: str = setting("acceptance", "when released workers train it: off, every, every-N or acceptance (below "
                         "train_fraction of its best acceptance)")
    train_every: int = setting(10, "RL steps between phases, for every-N")
    train_fraction: float = setting(0.9, "for acceptance: train when the level falls below this fraction of the best")
    min_pairs: int = setting(2048, "buffered pairs before the first phase")
    lr: float = setting(3e-4, "learning rate")
    warmup_steps: int = setting(20, "warm-up over the run's first drafter optimizer steps (protects a trained drafter)")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    batch_tokens: int = setting(2048, "pairs per optimizer step")
    rows: int = setting(4, "rows the pairs of a step are packed in (batch_tokens // rows each)")
    window: int = setting(256, "the last pairs of each response trained on")
    unroll: int = setting(3, "training-time-test rounds: deeper draft levels feed the drafter its own features")
    feature_weight: float = setting(1.0, "weight of the feature-regression loss")
    token_weight: float = setting(0.1, "weight of the next-token loss")
    grad_clip: float = setting(1.0, "gradient-norm clip")
    dtype: str = setting("float32", "float32, or bfloat16: a training step's forward and the held-out scoring under "
                         "bf16 autocast, weights, optimizer and loss in float32 (a bench-drafter step 2.5-2.7x faster on "
                         "a Xeon with AMX; with oneDNN held to AVX-512 BF16 1.5x slower, to AVX2 27x)")
    max_steps: int = setting(0, "optimizer steps per phase at most (0: until rollout ends)")
    holdout: float = setting(0.125, "fraction of the buffer's responses a phase keeps out of training at most (as "
                             "many as fill half a training batch) to score its drafter on, before its first step "
                             "and after each: it publishes its best-scoring step's weights, none if no step beat "
                             "the drafter it started from (0, or a phase that hot-swaps into the tail: the last "
                             "step's, unscored)")
    local_steps: int = setting(8, "optimizer steps per phase in-process (workers=1: on the critical path)")
    buffer_mb: int = setting(256, "megabytes of the online buffer")
    buffer_steps: int = setting(2, "policy versions the online buffer keeps")
    buffer_evict: str | None = setting(None, "module:function, entries -> kept entries (none: the last buffer_steps)")
    buffer_sample: str | None = setting(None, "module:function, entries -> weights (none: by length)")
    buffer_checkpoint: bool = setting(True, "run checkpoints carry the online buffer: resume trains on the same data")
    hot_swap_every: int = setting(0, "> 0: the spot trainer's drafter goes into tail workers every N optimizer steps")
    catch_up_window: int = setting(16, "pairs per row a drafting step after plain ones feeds the drafter, the newest "
                                   "(0: all; see speculative/decoder.py)")
    attention_window: int | None = setting(None, "pairs per row the drafter's attention keeps, the newest, once it "
                                           "holds twice as many (none: a quarter of the window its config records it was "
                                           "trained over; 0: the whole context; see speculative/decoder.py)")
    bits: int = setting(16, "weights the engines draft on: 16 (as trained) or 4 (rounded where tlt's bf16 CPU kernels "
                        "run the drafter: a quarter of the bytes; the samples are unchanged)")

    def __post_init__(self) -> None:
        check_choice(self, "train", WHEN)
        check_choice(self, "dtype", ("float32", "bfloat16"))
        check_numbers(self)
        for name in ("train_every", "min_pairs", "rows", "window", "unroll", "buffer_mb", "buffer_steps"):
            check_int(self, name, 1)
        for name in ("warmup_steps", "max_steps", "local_steps", "hot_swap_every", "catch_up_window"):
            check_int(self, name, 0)
        if self.attention_window is not None:
            check_int(self, "attention_window", 0)
        check_int(self, "bits", 4)
        check_choice(self, "bits", (4, 16))
        check(self, "train_fraction", 0 < self.train_fraction <= 1, "in (0, 1]")
        check(self, "holdout", 0 <= self.holdout < 1, "in [0, 1)")
        check(self, "lr", self.lr > 0, "> 0")
        check(self, "grad_clip", self.grad_clip > 0, "> 0")
        check(self, "batch_tokens", self.batch_tokens // self.rows >= self.window,
              f"at least rows * window = {self.rows * self.window}")

    @property
    def row_tokens(self) -> int:
        return self.batch_tokens // self.rows

    def loss_config(self):
        from tlt.speculative.train import DrafterTrainConfig

        return DrafterTrainConfig(steps=1, lr=self.lr, batch_tokens=self.batch_tokens, rows=self.rows,
                                  window=self.window, unroll=self.unroll, feature_weight=self.feature_weight,
                                  token_weight=self.token_weight, grad_clip=self.grad_clip)
