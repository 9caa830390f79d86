"""The spot trainer: drafter training in the idle time of rollout workers, stopped the moment rollout ends.

`SpotTrainer.train(batches, should_stop)` takes optimizer steps on the EAGLE loss (speculative/train.py)
until `should_stop()` turns true. It is checked before every step and inside the step in flight: after
each trainable module's forward, between training-time-test rounds, and in the backward pass as the
gradient passes each trainable module's output and reaches each trainable parameter. A step stopped
inside is dropped (gradients cleared, no update), so the weights are always those of a whole number of
steps, and a stop is honoured within one module's share of a forward or backward however long a step is
(a step of several rounds beside a busy rollout worker takes seconds, and a parameter's gradient arrives
only once the backward has passed every round; a phase that ran on would share its cores with the policy
update). `max_steps` caps a phase on top. The state that moves between workers (`state_dict`) is the
drafter's trainable weights, the optimizer state and the counters: the target's embedding and head are
never part of it.

Held-out check. A phase trains on a few steps' responses of a drafter that may already be at its best for
the policy (trained offline on it), and a handful of updates on so little data can leave it worse (by 2-4%
acceptance on the bench policy). So `run_phase` keeps up to `holdout` of the responses out of training
(`holdout()`: as many as fill half a training batch) and scores the drafter on them before its first
step and after each (`accept`, the mean over unrolled rounds of the target's probability of the drafter's
argmax: a one-token draft's acceptance under target-only verification at temperature 1); the phase
ends on its best-scoring weights, trainer state included, and publishes nothing when no step beat the
drafter it started from. Scoring runs inside the idle time and stops with the phase like a step; a step
not scored before the stop is not kept. A phase that offers its drafter to the tail mid-phase
(`hot_swap_every`) holds nothing out and publishes its last step's.

`run_phase` is one phase wherever it runs; a drafter an engine serves in bf16 / fp16 trains as a float32
twin. When phases run is schedule.py's; how their state is saved, checkpoint.py's.
"""

from __future__ import annotations

import copy
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from tlt.model.rope import RopeTables
from tlt.model.transformer import OnLMHead
from tlt.speculative.data import PackedBatch
from tlt.spot.config import SpotConfig


@dataclass
class PhaseReport:
    """What one spot phase did: its optimizer steps and seconds, why it stopped, the mean of each loss
    term (speculative.train.unrolled_loss) over its steps, the steps whose weights it published (`kept`)
    and the held-out scores at its start and of what it kept; on a pool also the worker it ran on, the
    drafter offers it made to the tail, and whether it was lost with its worker."""

    steps: int = 0
    kept: int = 0  # the published weights are those after this many of the steps (0: none published)
    heldout_start: float | None = None  # held-out score of the drafter the phase started from
    heldout_kept: float | None = None  # held-out score of the weights it published
    seconds: float = 0.0
    stop_latency_s: float | None = None  # from the stop request to the loop's exit
    stopped: str = "stop"  # stop, max_steps
    losses: dict[str, float] = field(default_factory=dict)
    worker: int | None = None
    offers: int = 0
    lost: bool = False


class Preempted(Exception):
    """A stop requested inside an optimizer step: the step is dropped, not applied."""


class SpotTrainer:
    def __init__(self, drafter, config: SpotConfig) -> None:
        self.drafter, self.config = drafter, config
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                           betas=(0.9, 0.95))
        self.steps = 0  # optimizer steps over the run
        self.version = 0  # drafter versions published (one per phase that kept a step)

    def train(self, batches: Iterator[PackedBatch], should_stop: Callable[[], bool],
              stop_requested_at: Callable[[], float | None] | None = None,
              after_step: Callable[[int], None] | None = None, heldout: PackedBatch | None = None) -> PhaseReport:
        """Optimizer steps until `should_stop()` (checked before each) or `max_steps`. `stop_requested_at`
        returns the perf_counter time of the stop request, to measure the preemption latency;
        `after_step(steps taken in this phase)` runs after each optimizer step. With `heldout`, the
        drafter is scored on it before the first step and after each, and the trainer ends on its
        best-scoring state (see the module docstring)."""
        from tlt.speculative.train import unrolled_loss

        c, loss_config = self.config, self.config.loss_config()
        device = self.drafter.target.device

        def interrupt() -> None:
            if should_stop():
                raise Preempted

        def on_grad(grad: torch.Tensor) -> torch.Tensor:
            interrupt()
            return grad

        def watch(module, inputs, output) -> None:
            interrupt()  # forward: a check per trainable module called as a module (training rounds)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(on_grad)  # backward: one as the gradient passes that module's output

        hooks = [p.register_hook(on_grad) for p in self.drafter.parameters() if p.requires_grad]
        hooks += [m.register_forward_hook(watch) for m in self.drafter.modules()
                  if any(p.requires_grad for p in m.parameters(recurse=False))]
        result, sums = PhaseReport(), {}
        # the best weights scored on the held-out batch so far: their score, trainer state and steps taken
        best_score, best_state, best_steps = None, None, 0
        start = time.perf_counter()
        try:
            if heldout is not None:
                heldout = heldout.to(device, self.drafter.fc.weight.dtype)
                best_score, best_state = self.score(heldout, interrupt), copy.deepcopy(self.state_dict())
                result.heldout_start = best_score
            self.drafter.train()
            while True:
                if should_stop():
                    result.stopped = "stop"
                    break
                if c.max_steps and result.steps >= c.max_steps:
                    result.stopped = "max_steps"
                    break
                batch = next(batches).to(device, self.drafter.fc.weight.dtype)
                for group in self.optimizer.param_groups:
                    group["lr"] = self.learning_rate()
                self.optimizer.zero_grad(set_to_none=True)
                try:
                    with self.autocast():
                        loss, m = unrolled_loss(self.drafter, batch, loss_config, interrupt)
                    loss.backward()
                except Preempted:
                    self.optimizer.zero_grad(set_to_none=True)
                    result.stopped = "stop"
                    break
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), c.grad_clip)
                self.optimizer.step()
                result.steps += 1
                self.steps += 1
                if after_step is not None:
                    after_step(result.steps)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                if best_score is not None:
                    scored = self.score(heldout, interrupt)
                    if scored > best_score:
                        best_score, best_state, best_steps = scored, copy.deepcopy(self.state_dict()), result.steps
                    self.drafter.train()
        except Preempted:  # a stop while scoring: that step is not kept
            result.stopped = "stop"
        finally:
            for hook in hooks:
                hook.remove()
            self.drafter.eval()
        if best_score is None:
            result.kept = result.steps
        else:
            result.kept, result.heldout_kept = best_steps, best_score
            if best_steps != result.steps:  # a later step scored lower: back to the best (or the start)
                self.load_state_dict(best_state)
        end = time.perf_counter()
        result.seconds = end - start
        requested = stop_requested_at() if stop_requested_at is not None else None
        if result.stopped == "stop" and requested is not None:
            result.stop_latency_s = max(end - requested, 0.0)
        result.losses = {k: v / result.steps for k, v in sums.items()} if result.steps else {}
        if result.kept:
            self.version += 1
        return result

    def score(self, batch: PackedBatch, between_rounds: Callable[[], None] | None = None) -> float:
        """The drafter's held-out score on `batch`: the mean over the unrolled rounds of `accept`."""
        from tlt.speculative.train import unrolled_loss

        if between_rounds is not None:
            between_rounds()  # unrolled_loss checks before each later round; scoring's forwards run no module hooks
        self.drafter.eval()
        with torch.no_grad(), self.autocast():
            _, m = unrolled_loss(self.drafter, batch, self.config.loss_config(), between_rounds)
        rounds = [m["accept"]] + [m[f"accept@{r}"] for r in range(2, self.config.unroll + 1)]
        return sum(rounds) / len(rounds)

    def autocast(self):
        """The context of a step's forward and of scoring: bf16 autocast with `dtype` bfloat16, else none (the
        backward follows the forward's dtypes; the weights, Adam's moments and the loss stay float32)."""
        return torch.autocast(self.drafter.target.device.type, dtype=torch.bfloat16,
                              enabled=self.config.dtype == "bfloat16")

    def learning_rate(self) -> float:
        """`lr`, ramped up linearly over the trainer's first `warmup_steps` optimizer steps (over all
        phases): a fresh Adam's first updates are about lr in every weight whatever the gradient, which
        would knock an already trained drafter off its optimum."""
        c = self.config
        return c.lr * min(1.0, (self.steps + 1) / c.warmup_steps) if c.warmup_steps else c.lr

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"drafter": self.drafter.trainable_state(), "optimizer": self.optimizer.state_dict(),
                "steps": self.steps, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict({k: v.to(self.drafter.fc.weight.dtype) for k, v in state["drafter"].items()})
        # a copy: Adam updates its moments in place, and `state` (the run's last published one) must not move
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.steps, self.version = int(state["steps"]), int(state["version"])


def run_phase(drafter, state: dict | None, records: list, weights: list[float], config: SpotConfig, seed: int,
              should_stop: Callable[[], bool] = lambda: False, stop_requested_at=None,
              after_step=None) -> tuple[dict, PhaseReport]:
    """One spot phase on `drafter` (trained in place) from the trainer state `state` (None: fresh), over
    `records` drawn by `weights`; returns (new trainer state, phase report). Where the phase runs, in
    the driver or on a Ray worker, is the caller's business."""
    from tlt.spot.buffer import Entry, sampled_batches

    # An engine in bf16 / fp16 keeps serving its drafter in that dtype; training runs on a float32 twin,
    # whose weights go back into the engine's drafter (cast) after the phase and before each hook.
    trained = drafter if drafter.fc.weight.dtype == torch.float32 else float32_twin(drafter)

    def publish() -> None:
        if trained is not drafter:
            with torch.no_grad():
                for name, tensor in drafter.state_dict().items():
                    tensor.copy_(trained.state_dict()[name])

    def hook(steps: int) -> None:
        publish()
        after_step(steps)

    trainer = SpotTrainer(trained, config)
    if state is not None:
        trainer.load_state_dict(state)
    # a phase that offers its drafter to the tail mid-phase publishes its last step's: the tail runs it already
    indices, heldout = holdout(records, weights, config, seed) if after_step is None else ([], None)
    held = set(indices)
    entries = [Entry(r, 0, j) for j, r in enumerate(records) if j not in held]
    batches = sampled_batches(entries, [w for j, w in enumerate(weights) if j not in held], config.rows,
                              config.row_tokens, config.window, seed)
    result = trainer.train(batches, should_stop, stop_requested_at, hook if after_step is not None else None, heldout)
    publish()
    return trainer.state_dict(), result


def holdout(records: list, weights: list[float], config: SpotConfig,
            seed: int) -> tuple[list[int], PackedBatch | None]:
    """The responses a phase scores its drafter on and does not train on, and their packed batch: of the
    responses it could train on (2 or more tokens, a positive sampling weight), at most `holdout` and never
    all, in an order drawn by `seed`, those whose last `window` pairs fill half a training batch's rows (at
    least one row), packed as a training batch's are; none when fewer than 2 such responses exist (the phase
    then trains on all and publishes its last step's). Scoring then costs about a sixth of an optimizer step
    (a forward over half the pairs, against a forward and backward over all)."""
    from tlt.speculative.data import fill_rows, pack, record_pairs

    usable = [j for j, (r, w) in enumerate(zip(records, weights)) if r.tokens.shape[0] >= 2 and w > 0]
    if config.holdout == 0 or len(usable) < 2:
        return [], None
    count = min(max(1, round(config.holdout * len(usable))), len(usable) - 1)
    drawn = random.Random(seed).sample(usable, count)
    windows = [record_pairs(records[j], config.window) for j in drawn]
    rows = list(itertools.islice(fill_rows(iter(windows), config.row_tokens), max(1, config.rows // 2)))
    packed = {id(p) for row in rows for p in row}
    return [j for j, p in zip(drawn, windows) if id(p) in packed], pack(rows, config.row_tokens)


class TargetHead(OnLMHead, torch.nn.Module):
    """The only parts of a target a drafter uses (embedding, LM head, RoPE tables, config), as float32
    copies: what a float32 twin of a bf16 / fp16 engine's drafter trains against."""

    def __init__(self, target) -> None:
        super().__init__()
        c = self.config = target.config
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            if c.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
            else:
                self.lm_head.weight.copy_(target.lm_head.weight)
        self.register_buffer("inv_freq", target.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling_factor = target.rope_scaling_factor
        self.rope = RopeTables()
        self.requires_grad_(False)
        self.to(target.device)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits [..., V] (what a drafter's forward without gradients calls: scoring)."""
        return torch.nn.functional.linear(hidden, self.lm_head.weight)


def float32_twin(drafter):
    """A float32 copy of `drafter` (trainable weights) over a float32 `TargetHead` of its target."""
    from tlt.speculative.drafter import Drafter

    twin = Drafter(TargetHead(drafter.target), drafter.config)
    twin.load_state_dict({k: v.float() for k, v in drafter.state_dict().items()})
    return twin
