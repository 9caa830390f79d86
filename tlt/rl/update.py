"""The policy update: one optimizer step per mini-batch slice of groups, over packed micro-batches.

Each slice's loss is a sum of per-token terms whose weights (`token_weights`) already normalise over
the whole slice, so the gradients of any partition of its responses add up to the full-slice
gradient. That makes one code path serve one process and N: rank r runs its share of each slice
(`shard`), the per-rank gradient sums and diagnostic sums are all-reduced with SUM, and every rank then
clips and steps identically. With one process the share is the whole slice and nothing is reduced.
Responses cross process boundaries as `Sample` records: token ids, the advantage and the old and
reference log-probs the loss needs, nothing of the example or its text.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tlt.errors import TrainingError
from tlt.rl.config import OptimConfig, TrainConfig
from tlt.rl.episode import Episode, MicroBatch, pack
from tlt.rl.grpo import entropy, policy_loss, token_weights

# Diagnostic sums reduced over ranks per slice, after the loss and the weight seen.
PARTS = ("ratio", "clip_fraction", "kl", "entropy", "tis_ratio", "tis_clipped")


class Diverged(TrainingError):
    """A non-finite loss or gradient norm; every rank sees the same reduced value, so all raise it."""


@dataclass
class Sample:
    """One response as the update sees it."""

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    old_logprobs: torch.Tensor  # [T] the policy's before the update, per completion token
    ref_logprobs: torch.Tensor | None = None  # [T] the reference's, when there is a KL term
    rollout_logprobs: torch.Tensor | None = None  # [T] the engine's, when old_logprobs were recomputed

    @classmethod
    def of(cls, episode: Episode, old: dict, ref: dict, recomputed: bool) -> "Sample":
        """From an episode and the trainer's recomputed old / reference log-probs keyed by id(episode)
        (`recomputed` False: the engine's log-probs are the old ones). A response the update's forward
        skips has none recomputed and needs none. Copies, so no view pins a micro-batch's tensor."""
        rollout = torch.tensor(episode.logprobs)
        if recomputed and id(episode) not in old and episode.advantage != 0.0:
            raise KeyError(f"no recomputed old log-probs for a response the update runs (advantage {episode.advantage})")
        old_lp = old[id(episode)].clone() if id(episode) in old else rollout
        return cls(episode.group, episode.prompt_ids, episode.completion_ids, episode.advantage, old_lp,
                   ref[id(episode)].clone() if ref else None, rollout if recomputed else None)


def build_optimizer(policy: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; every rank builds the same one."""
    decay = [p for p in policy.parameters() if p.dim() >= 2]
    other = [p for p in policy.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.beta1, config.beta2))


def token_logprobs(model, batch: MicroBatch, config: TrainConfig, with_entropy: bool = False):
    """(log-probs [N], entropies [N] or None) of a micro-batch's response tokens under `model`, with
    the same temperature / top-k / top-p warping the engine sampled with."""
    from tlt.rollout.sampling import warp_logprobs

    device = model.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if config.dtype == "bfloat16" \
        else contextlib.nullcontext()
    with autocast:
        out = model(batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                    logit_index=batch.logit_index.to(device))
    logits = out.logits[batch.target_mask.to(device)].float()  # [N, V]
    n = len(logits)
    logprobs = warp_logprobs(logits, torch.full((n,), config.temperature, device=device),
                             torch.full((n,), config.top_k, dtype=torch.long, device=device),
                             torch.full((n,), config.top_p, device=device))  # [N, V]
    tokens = batch.targets().to(device)  # [N]
    picked = logprobs.gather(1, tokens[:, None])[:, 0]  # [N]
    return picked, (entropy(logprobs) if with_entropy else None)


def shard(samples: list[Sample], rank: int, world: int) -> list[Sample]:
    """Rank `rank`'s share of a slice, in the slice's order: longest first to the least-loaded rank, so
    token counts balance even when the slice packs into fewer micro-batches than there are ranks.
    Rank 0 always gets the longest, so it runs a micro-batch whenever any rank does."""
    size = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    load, owner = [0] * world, [0] * len(samples)
    for i in sorted(range(len(samples)), key=lambda i: -size[i]):
        owner[i] = min(range(world), key=load.__getitem__)
        load[owner[i]] += size[i]
    return [s for s, o in zip(samples, owner) if o == rank]


def all_reduce_sum(tensors: list[torch.Tensor], world: int, bucket: int = 1 << 24) -> None:
    """Sum each tensor over the ranks in place: one collective per bucket of up to `bucket` elements
    of one dtype, rather than one per tensor. Nothing to do for a single process."""
    if world == 1:
        return
    filling: dict[torch.dtype, list[torch.Tensor]] = {}
    buckets: list[list[torch.Tensor]] = []
    for t in tensors:
        members = filling.setdefault(t.dtype, [])
        if members and sum(x.numel() for x in members) + t.numel() > bucket:
            buckets.append(members)
            members = filling[t.dtype] = []
        members.append(t)
    for group in buckets + list(filling.values()):
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        for t, part in zip(group, flat.split([t.numel() for t in group])):
            t.copy_(part.view_as(t))


def update_slices(items: list, config: TrainConfig, rank: int = 0,
                  world: int = 1) -> list[tuple[list, list, list[MicroBatch]]]:
    """The optimizer steps of an update over `items` (samples or episodes, with their group and advantage):
    per step, its slice of the groups, the slice's responses the forward runs (on all ranks together)
    and the micro-batches of this rank's share of them. A response with advantage 0 adds exactly nothing to the surrogate's gradient; unless KL
    or entropy terms touch it, it is left out of the forward (it still counts in the normaliser), so
    the many all-equal groups cost no compute. The trainer recomputes old log-probs over these very
    micro-batches, so the first one's ratio is exactly 1."""
    c, loss = config.optim, config.loss
    groups = sorted({s.group for s in items})
    slices = [set(s.tolist()) for s in np.array_split(np.array(groups), min(c.mini_batches, len(groups)))]
    skip = loss.skip_zero_advantage and loss.kl_coef == 0 and loss.entropy_coef == 0
    out = []
    for members in slices:
        batch = [s for s in items if s.group in members]
        active = [s for s in batch if s.advantage != 0.0] if skip else batch
        out.append((batch, active, pack(shard(active, rank, world), c.row_tokens, c.micro_batch_tokens)))
    return out


def update_policy(policy, optimizer: torch.optim.Optimizer, config: TrainConfig, samples: list[Sample], lr: float,
                  rank: int = 0, world: int = 1) -> dict:
    """`config.optim.mini_batches` optimizer steps over `samples`, this rank running its share of each slice;
    every rank of `world` calls it with the same samples. Returns the step's diagnostics (identical on
    every rank but the first micro-batch's ratio deviation, which is this rank's)."""
    c, loss_config = config.optim, config.loss
    device = policy.device
    for group in optimizer.param_groups:
        group["lr"] = lr
    slices = update_slices(samples, config, rank, world)
    totals = {"loss": 0.0, "grad_norm": 0.0, **{k: 0.0 for k in PARTS}}
    first_dev = None
    params = list(policy.parameters())
    policy.train()
    ran = 0
    for batch, active, micro_batches in slices:
        n_tokens = sum(len(s.completion_ids) for s in batch)
        optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(2 + len(PARTS), dtype=torch.float64, device=device)  # loss, weight seen, PARTS
        for mb in micro_batches:
            logp, ent = token_logprobs(policy, mb, config, with_entropy=True)
            lengths = torch.tensor([len(s.completion_ids) for s in mb.episodes])
            old_lp = torch.cat([s.old_logprobs for s in mb.episodes]).to(device)  # [N]
            refs = [s.ref_logprobs for s in mb.episodes]
            ref_lp = torch.cat(refs).to(device) if refs[0] is not None else None  # [N]
            behaviour = ([s.rollout_logprobs for s in mb.episodes] if loss_config.tis_cap > 0 else [None])
            mu_lp = torch.cat(behaviour).to(device) if behaviour[0] is not None else None  # [N]
            adv = torch.tensor([s.advantage for s in mb.episodes]).repeat_interleave(lengths).to(device)  # [N]
            weights = token_weights(lengths, loss_config.aggregation, n_tokens, len(batch)).to(device)  # [N]
            loss, parts = policy_loss(logp, old_lp, adv, weights, loss_config, ref_lp, ent, mu_lp)
            sums[0] += loss.detach()
            if not torch.isfinite(loss):  # the reduced loss is then non-finite on every rank
                break
            if first_dev is None:
                first_dev = float((logp.detach() - old_lp).exp().sub(1).abs().max())
            loss.backward()
            sums[1] += weights.sum()
            sums[2:] += torch.stack([parts[k] for k in PARTS])
        all_reduce_sum([sums], world)
        if not torch.isfinite(sums[0]):
            raise Diverged(f"the loss is {sums[0].item()}")
        totals["loss"] += sums[0].item() / len(slices)
        # Diagnostics average over the responses that were run (all of them unless skipped).
        if active:
            for k, v in zip(PARTS, (sums[2:] / sums[1]).tolist()):
                totals[k] += v / len(slices)
        ran += len(active)
        for p in params:
            if p.grad is None:  # nothing was run: the same Adam step as an all-zero gradient
                p.grad = torch.zeros_like(p)
        all_reduce_sum([p.grad for p in params], world)
        norm = torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        if not torch.isfinite(norm):
            raise Diverged(f"the gradient norm is {norm.item()}")
        totals["grad_norm"] += norm.item() / len(slices)
        optimizer.step()
    if not ran:
        totals.update({k: None for k in PARTS})
    if loss_config.tis_cap == 0:  # nothing to report
        del totals["tis_ratio"], totals["tis_clipped"]
    return {**totals, "lr": lr, "ratio_first_max_dev": first_dev, "responses_in_update": ran}
