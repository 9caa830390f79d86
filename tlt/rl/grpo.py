"""GRPO math: group-relative advantages, the clipped surrogate, the k3 KL estimator, entropy.

Pure tensor functions, named as in the papers (GRPO: Shao et al. 2024; DAPO: Yu et al. 2025).
  advantage   A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (std optional: Dr. GRPO drops it)
  ratio       rho_t = exp(logp_t - logp_old_t)
  surrogate   L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)   (clip-higher: eps_high > eps_low)
  KL (k3)     k3_t = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1 >= 0, unbiased for KL(pi || ref)
  TIS         w_t = min(pi_old(y_t) / mu(y_t), C): truncated importance sampling for rollouts sampled from a
              behaviour policy mu other than pi_old (bf16 engines for a float32 trainer); it weights the
              surrogate of each token, with no gradient through it
Aggregation: "token" averages over every response token of the whole step batch (DAPO); "sequence"
averages each response over its own tokens, then over responses (the original GRPO). Both take the
normaliser as an argument so that micro-batches with gradient accumulation add up to exactly the loss of
the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.config import check, check_choice, check_numbers, setting
from tlt.errors import TrainingError


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages [N] of rewards [N] against the mean (and std) of their group; groups [N] are group ids.
    A group whose rewards are all equal gets advantage 0 for every member."""
    rewards = rewards.double()
    ids, inverse = torch.unique(groups, return_inverse=True)  # [G], [N]
    count = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))  # [G]
    mean = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, rewards) / count  # [G]
    centred = rewards - mean[inverse]  # [N]
    if not normalize_std:
        advantages = centred.float()
        if not torch.isfinite(advantages).all():  # rewards of float32's range can differ by more than it holds
            member = int((~torch.isfinite(advantages)).nonzero()[0, 0])
            in_group = rewards[groups == groups[member]]
            raise TrainingError(
                f"group {groups[member].item()}: rewards from {in_group.min().item():.4g} to {in_group.max().item():.4g} "
                f"give advantages beyond float32's range with loss.normalize_std=false; scale the reward down "
                f"or set loss.normalize_std=true")
        return advantages
    # Unbiased std, as torch.std: a group of one has no spread, its advantage is 0 anyway.
    square = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, centred**2)  # [G]
    std = (square / (count - 1).clamp(min=1)).sqrt()  # [G]
    return (centred / (std[inverse] + eps)).float()


def zero_variance_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Mask [N]: True where the sample's group has all-equal rewards (no learning signal)."""
    ids, inverse = torch.unique(groups, return_inverse=True)
    high = torch.full((len(ids),), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amax")
    low = torch.full((len(ids),), torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amin")
    return (high == low)[inverse]


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from log-probs of the sampled tokens (same shape)."""
    log_ratio = ref_logp - logp
    return log_ratio.exp() - log_ratio - 1


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of distributions given as log-probs [..., V] (-inf entries contribute 0)."""
    p = logprobs.exp()
    return -(p * logprobs.masked_fill(p == 0, 0)).sum(-1)


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = setting(0.2, "eps_low: the ratio is clipped below at 1 - clip_low")
    clip_high: float = setting(0.28, "eps_high: the ratio is clipped above at 1 + clip_high (clip-higher)")
    aggregation: str = setting("token", "token (the mean over every response token) or sequence (per response)")
    kl_coef: float = setting(0.0, "weight of the k3 KL to a frozen reference (> 0 loads one)")
    entropy_coef: float = setting(0.0, "weight of the entropy bonus")
    # > 0 (and old_logprobs=recompute): each token's surrogate weighted by min(pi_old / mu, tis_cap), mu
    # the engine's probability of the token (a bf16 engine samples from a slightly different distribution
    # than the float32 trainer's pi_old); logged as tis_ratio, tis_clipped
    tis_cap: float = setting(0.0, "C of truncated importance sampling (0: off; needs old_logprobs=recompute)")
    normalize_std: bool = setting(True, "divide advantages by the group's reward std (false: Dr. GRPO)")
    filter_groups: bool = setting(False, "drop groups whose rewards are all equal (they carry no signal)")
    skip_zero_advantage: bool = setting(True, "leave responses with advantage 0 out of the forward (exact without "
                                        "KL or entropy terms: they add nothing to the gradient)")
    old_logprobs: str = setting("rollout", "pi_old: the engine's log-probs (rollout) or a trainer forward before "
                                "the update (recompute)")

    def __post_init__(self) -> None:
        check_numbers(self)
        check_choice(self, "aggregation", ("token", "sequence"))
        check(self, "clip_low", 0 <= self.clip_low < 1, "in [0, 1)")
        for name in ("clip_high", "kl_coef", "entropy_coef"):
            check(self, name, getattr(self, name) >= 0, ">= 0")
        check(self, "tis_cap", self.tis_cap == 0 or self.tis_cap >= 1, "0 (off) or >= 1")
        check_choice(self, "old_logprobs", ("rollout", "recompute"))


def token_weights(lengths: torch.Tensor, aggregation: str, total_tokens: int, total_responses: int) -> torch.Tensor:
    """Per-token weights [sum(lengths)] of responses with `lengths` [B] (concatenated in order), such
    that the weighted sum over every micro-batch of a step is its "token" or "sequence" mean."""
    if aggregation == "token":
        return torch.full((int(lengths.sum()),), 1.0 / total_tokens)
    per_response = 1.0 / (lengths.clamp(min=1).double() * total_responses)  # [B]
    return per_response.repeat_interleave(lengths).float()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    ref_logp: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    behaviour_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one micro-batch and its parts, all weighted sums so micro-batches add up.

    Every argument is per response token, flat [N]: log-probs under the policy (with gradient), before
    the update (old) and under the reference; the advantage of the token's response; the token's weight
    from `token_weights`; the entropy of the policy's distribution at the token; the log-prob the token
    was sampled with (behaviour, needed by `tis_cap`)."""
    ratio = (logp - old_logp).exp()  # [N]
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)  # [N]
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)  # [N]
    is_clipped = (ratio * advantages > clipped * advantages).to(logp.dtype)  # [N]: the clip is active
    tis_ratio = torch.ones_like(logp)  # [N] pi_old / mu
    if config.tis_cap > 0:
        if behaviour_logp is None:
            raise ValueError("tis_cap > 0 needs the behaviour log-probs the tokens were sampled with")
        tis_ratio = (old_logp - behaviour_logp).exp().detach()  # [N]
        per_token = per_token * tis_ratio.clamp(max=config.tis_cap)
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)  # [N]
    if config.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference log-probs")
        per_token = per_token + config.kl_coef * kl
    if entropies is None:
        entropies = torch.zeros_like(logp)
    if config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * entropies
    loss = (per_token * weights).sum()
    parts = {
        "ratio": (ratio.detach() * weights).sum(),
        "clip_fraction": (is_clipped.detach() * weights).sum(),
        "kl": (kl.detach() * weights).sum(),
        "entropy": (entropies.detach() * weights).sum(),
        "tis_ratio": (tis_ratio * weights).sum(),
        "tis_clipped": ((tis_ratio > config.tis_cap).to(logp.dtype) * weights).sum() if config.tis_cap > 0
        else torch.zeros((), dtype=logp.dtype, device=logp.device),
    }
    return loss, parts
