"""GRPO math against hand-computed values: advantages, token weights, the clipped surrogate, k3 KL,
entropy, and packing episodes into micro-batches."""

import math

import pytest
import torch

from tlt.data import Example
from tlt.errors import TrainingError
from tlt.rl.episode import Episode, pack
from tlt.rl.grpo import (LossConfig, entropy, group_advantages, kl_k3, policy_loss, token_weights,
                         zero_variance_groups)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    # group 0: mean 1/3, unbiased std sqrt(1/3); group 1: mean 2/3, same std
    std = math.sqrt(1 / 3)
    expected = [(1 - 1 / 3) / std, -1 / 3 / std, -1 / 3 / std, (1 / 3) / std, (1 / 3) / std, -2 / 3 / std]
    got = group_advantages(rewards, groups, normalize_std=True, eps=0.0)
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    centred = group_advantages(rewards, groups, normalize_std=False)
    assert centred.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3], rel=1e-6)


def test_zero_variance_groups_get_zero_advantage_and_are_flagged():
    rewards = torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    groups = torch.tensor([3, 3, 7, 7, 9, 9])
    adv = group_advantages(rewards, groups)
    assert adv[0] == 0 and adv[1] == 0 and adv[4] == 0 and adv[5] == 0
    assert adv[2] > 0 > adv[3]
    assert zero_variance_groups(rewards, groups).tolist() == [True, True, False, False, True, True]


def test_rewards_whose_spread_float32_cannot_hold_are_named_not_turned_into_inf():
    """Regression: with loss.normalize_std=false rewards of +-3e38 (each within float32's range) gave an
    advantage of inf, and the run stopped later on "the loss is nan" with nothing pointing at the reward."""
    big = 3e38
    rewards = torch.tensor([0.0, 1.0, big, big, big, -big])  # group 5's mean is 1.5e38: -big sits 4.5e38 below
    groups = torch.tensor([0, 0, 5, 5, 5, 5])
    with pytest.raises(TrainingError, match=r"^group 5: rewards from -3e\+38 to 3e\+38 give advantages beyond "
                                            r"float32's range with loss.normalize_std=false; scale the reward down "
                                            r"or set loss.normalize_std=true$"):
        group_advantages(rewards, groups, normalize_std=False)
    normalized = group_advantages(rewards, groups, normalize_std=True)  # divided by the group's spread: finite
    assert torch.isfinite(normalized).all() and normalized[2] > 0 > normalized[5]


def test_token_weights_token_and_sequence_means():
    lengths = torch.tensor([2, 3])
    assert token_weights(lengths, "token", 10, 4).tolist() == pytest.approx([0.1] * 5)
    # each response averaged over its own tokens, then over the 4 responses of the step
    assert token_weights(lengths, "sequence", 10, 4).tolist() == pytest.approx([1 / 8, 1 / 8, 1 / 12, 1 / 12, 1 / 12])


def test_clipped_surrogate_by_hand():
    config = LossConfig(clip_low=0.2, clip_high=0.3)
    old = torch.zeros(4)
    # ratios 1.5, 0.5, 1.5, 0.5 with advantages +1, +1, -1, -1
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    w = torch.full((4,), 0.25)
    loss, parts = policy_loss(logp, old, adv, w, config)
    # per token: -min(r A, clip(r) A)
    #   r=1.5, A=+1: min(1.5, 1.3) = 1.3      (clipped above)
    #   r=0.5, A=+1: min(0.5, 0.8) = 0.5      (not clipped: pessimistic side)
    #   r=1.5, A=-1: min(-1.5, -1.3) = -1.5   (not clipped)
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8   (clipped below)
    assert loss.item() == pytest.approx(-(1.3 + 0.5 - 1.5 - 0.8) / 4)
    assert parts["clip_fraction"].item() == pytest.approx(0.5)
    assert parts["ratio"].item() == pytest.approx(1.0)


def test_truncated_importance_sampling_by_hand():
    """Each token's surrogate is weighted by min(pi_old / mu, C), with no gradient through the weight;
    with mu = pi_old it is the plain loss."""
    old = torch.log(torch.tensor([0.5, 0.5, 0.2, 0.4]))
    mu = torch.log(torch.tensor([0.25, 0.5, 0.4, 0.1]))  # pi_old / mu = 2, 1, 0.5, 4
    logp = (old + torch.tensor([0.1, -0.1, 0.05, 0.0])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    w = torch.full((4,), 0.25)
    config = LossConfig(tis_cap=3.0)
    plain, _ = policy_loss(logp, old, adv, w, LossConfig())
    per_token = -torch.minimum((logp - old).exp() * adv, (logp - old).exp().clamp(0.8, 1.28) * adv)
    expected = (per_token * torch.tensor([2.0, 1.0, 0.5, 3.0]) * w).sum()
    loss, parts = policy_loss(logp, old, adv, w, config, behaviour_logp=mu)
    assert loss.item() == pytest.approx(expected.item())
    assert parts["tis_ratio"].item() == pytest.approx((2 + 1 + 0.5 + 4) / 4)
    assert parts["tis_clipped"].item() == pytest.approx(0.25)  # one token of four above the cap
    grad, = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, torch.autograd.grad(expected, logp)[0])  # the weights are constants
    same, _ = policy_loss(logp, old, adv, w, config, behaviour_logp=old)
    assert same.item() == pytest.approx(plain.item())
    with pytest.raises(ValueError, match="behaviour log-probs"):
        policy_loss(logp, old, adv, w, config)


def test_clip_gradient_is_zero_where_clipped():
    config = LossConfig(clip_low=0.2, clip_high=0.2)
    logp = torch.log(torch.tensor([1.5, 1.1])).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(2), torch.ones(2), torch.ones(2), config)
    loss.backward()
    assert logp.grad[0] == 0  # ratio 1.5 > 1.2 with A > 0: clipped, no gradient
    assert logp.grad[1] == pytest.approx(-1.1)  # d(-r)/dlogp = -r


def test_kl_k3_estimator():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -1.5])
    x = ref - logp
    assert kl_k3(logp, ref).tolist() == pytest.approx((x.exp() - x - 1).tolist())
    assert kl_k3(logp, logp).abs().max() == 0
    assert (kl_k3(logp, ref) >= 0).all()
    # unbiased: E_pi[k3] = KL(pi || ref) for a categorical pi
    pi, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    expected = float((pi * (pi / q).log()).sum())
    estimate = float((pi * kl_k3(pi.log(), q.log())).sum())
    assert estimate == pytest.approx(expected, rel=1e-6)


def test_kl_and_entropy_enter_the_loss():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    ent = torch.tensor([0.3, 0.7])
    w = torch.tensor([0.5, 0.5])
    base, _ = policy_loss(logp, logp, torch.zeros(2), w, LossConfig())
    with_kl, parts = policy_loss(logp, logp, torch.zeros(2), w, LossConfig(kl_coef=0.1, entropy_coef=0.01), ref, ent)
    expected = 0.1 * float((kl_k3(logp, ref) * w).sum()) - 0.01 * float((ent * w).sum())
    assert (with_kl - base).item() == pytest.approx(expected)
    assert parts["entropy"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, logp, torch.zeros(2), w, LossConfig(kl_coef=0.1))


def test_entropy_of_warped_distribution_ignores_removed_tokens():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]])
    assert entropy(logprobs).item() == pytest.approx(math.log(2))


def test_loss_config_rejects_bad_values():
    from tlt.errors import ConfigError

    with pytest.raises(ConfigError, match="aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(ConfigError, match="clip_low"):
        LossConfig(clip_low=1.5)


def _episode(group, prompt_len, completion_len):
    return Episode(group, Example("x"), list(range(3, 3 + prompt_len)), list(range(5, 5 + completion_len)),
                   [-0.1] * completion_len, "stop", "")


def test_pack_keeps_every_response_token_once_in_episode_order():
    episodes = [_episode(i, 3 + i % 4, 1 + (7 * i) % 11) for i in range(13)]
    batches = pack(episodes, row_tokens=20, micro_batch_tokens=48)
    seen = [id(e) for b in batches for e in b.episodes]
    assert sorted(seen) == sorted(id(e) for e in episodes)
    for b in batches:
        assert b.input_ids.numel() <= 48 or b.input_ids.shape[0] == 1
        assert b.targets().tolist() == [t for e in b.episodes for t in e.completion_ids]
        # the logit position before each target holds the previous token of the same episode
        for r in range(b.input_ids.shape[0]):
            pos = b.position_ids[r]
            index = b.logit_index[r][b.target_mask[r]]
            assert (pos[index + 1] == pos[index] + 1).all()


def test_packed_logprobs_equal_separate_forwards(tiny_model):
    tiny_model = tiny_model()
    episodes = [_episode(i, 2 + i, 3 + 2 * i) for i in range(4)]
    batch = pack(episodes, row_tokens=64, micro_batch_tokens=256)[0]
    out = tiny_model(batch.input_ids, position_ids=batch.position_ids, logit_index=batch.logit_index)
    packed = out.logits[batch.target_mask].log_softmax(-1)
    at = 0
    for e in batch.episodes:
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        alone = tiny_model(ids).logits[0, len(e.prompt_ids) - 1 : -1].log_softmax(-1)
        assert torch.allclose(packed[at : at + len(e.completion_ids)], alone, atol=1e-5)
        at += len(e.completion_ids)
