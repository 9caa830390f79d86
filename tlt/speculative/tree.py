"""Drafting with the learned drafter: EAGLE-2 dynamic trees, and chains as their one-branch case.

A `Draft` is a batch of token trees, node 0 of each being the root (the pending token, already
sampled, whose position is the target cache length n). Node j > 0 has a token, a parent and a depth
(position n + depth). `ancestors` is the [B, N, N] mask the target's verification forward uses.

Tree expansion, level by level, batched over rows:
  level 1: the topk tokens of the drafter's distribution after the root;
  level d+1: the drafter runs on the current frontier (pair = parent's f_hat, node token) attending to
    its cache plus the node's own ancestors among the draft slots already written (a tree mask over the
    trailing cached slots); each frontier node proposes its topk children, scored by cumulative draft
    log-prob; the topk best of the topk^2 children form the next frontier.
All proposed nodes compete at the end: the `verify_tokens` with the best cumulative log-prob are kept.
A node's score is below its parent's (log q <= 0, plus a tiny depth penalty for exact ties), so the
kept set always contains its ancestors. The drafter's cache is rolled back to its committed length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.rollout import rng
from tlt.rollout.sampling import sample_from, warp_logprobs


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, N] (node 0: the root token)
    parents: torch.Tensor  # [B, N] parent index, -1 at the root, -2 for padding
    depth: torch.Tensor  # [B, N] 0 at the root
    valid: torch.Tensor  # [B, N] bool, padding is right-aligned
    q: torch.Tensor | None = None  # [B, k, V] draft probabilities of a sampled chain

    @property
    def ancestors(self) -> torch.Tensor:
        """[B, N, N]: node i may attend to node j iff j is i or one of its ancestors."""
        B, N = self.tokens.shape
        device = self.tokens.device
        anc = torch.eye(N, dtype=torch.bool, device=device).expand(B, N, N).clone()
        node = torch.arange(N, device=device).expand(B, N)
        up = self.parents  # [B, N] after i passes: each node's ancestor i + 1 levels up (< 0: none)
        for _ in range(int(self.depth.max()) if N else 0):  # one pass per level, not one per node
            ok = up >= 0
            anc.scatter_(2, torch.where(ok, up, node)[..., None], True)  # without an ancestor: itself again
            up = torch.where(ok, self.parents.gather(1, up.clamp(min=0)), up)
        return anc


def chain_draft(root: torch.Tensor, proposals: list[list[int]]) -> Draft:
    """A one-branch tree per row from token lists (n-gram drafts), right-padded."""
    B = root.shape[0]
    N = 1 + max((len(p) for p in proposals), default=0)
    tokens = torch.zeros(B, N, dtype=torch.long, device=root.device)
    parents = torch.full((B, N), -2, dtype=torch.long, device=root.device)
    tokens[:, 0], parents[:, 0] = root, -1
    for b, prop in enumerate(proposals):
        if prop:
            tokens[b, 1 : 1 + len(prop)] = torch.tensor(prop, device=root.device)
            parents[b, 1 : 1 + len(prop)] = torch.arange(len(prop), device=root.device)
    depth = torch.arange(N, device=root.device).expand(B, N).clone()
    return Draft(tokens, parents, depth, parents > -2)


def expand(drafter, cache, f0: torch.Tensor, logits0: torch.Tensor, base: torch.Tensor, strategy, batch) -> Draft:
    """Draft from the drafter's state. f0 [B, H], logits0 [B, V]: its output after the root (the
    feature f_hat at the root's position and the distribution of the next token); base [B]: the root's
    position. Chains sample from the warped q (stream 3) so that speculative sampling can use q."""
    B = f0.shape[0]
    device = f0.device
    committed = cache.lengths.clone()
    k = 1 if strategy.kind == "chain" else strategy.topk
    rows = torch.arange(B, device=device)
    # Pool of proposed nodes (excluding the root), filled level by level.
    pool_tokens, pool_parent, pool_score, pool_depth = [], [], [], []
    q_rows = []
    frontier_feat = f0[:, None]  # [B, 1, H]
    frontier_logits = logits0[:, None]  # [B, 1, V]
    frontier_index = torch.full((B, 1), -1, device=device, dtype=torch.long)  # pool index, -1 = root
    frontier_score = torch.zeros(B, 1, device=device)
    # What each frontier node sees among the draft slots already in the drafter cache (its ancestors):
    # [B, F, D]. A child sees what its parent saw plus the parent's own slot, so the tree mask of the
    # next drafter call is its parents' rows of the last call's mask, then the new nodes themselves.
    frontier_seen = torch.zeros(B, 1, 0, dtype=torch.bool, device=device)
    itself = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    for level in range(1, strategy.depth + 1):
        F = frontier_logits.shape[1]
        if strategy.kind == "chain":
            lp = warp_logprobs(frontier_logits[:, 0], batch.temperature, batch.top_k, batch.top_p)  # [B, V]
            u = rng.uniform(batch.keys, batch.counters + level, stream=3)
            tok = torch.where(batch.temperature > 0, sample_from(lp, u), lp.argmax(-1))
            q_rows.append(lp.exp())
            child_tok = tok[:, None]  # [B, 1]
            child_score = frontier_score + lp.gather(1, tok[:, None])
            child_from = torch.zeros(B, 1, dtype=torch.long, device=device)
        else:
            lp = frontier_logits.float().log_softmax(-1)  # [B, F, V]
            top_lp, top_tok = lp.topk(k, dim=-1)  # [B, F, k]
            cand = (frontier_score[..., None] + top_lp).flatten(1)  # [B, F*k]
            child_tok, child_score = top_tok.flatten(1), cand
            child_from = torch.arange(F, device=device).repeat_interleave(k).expand(B, F * k)
        start = sum(t.shape[1] for t in pool_tokens)
        pool_tokens.append(child_tok)
        pool_parent.append(torch.gather(frontier_index, 1, child_from))
        pool_score.append(child_score - 1e-6 * level)
        pool_depth.append(torch.full_like(child_tok, level))
        if level == strategy.depth:
            break
        # The next frontier: the k best children, run through the drafter.
        best = child_score.topk(min(k, child_score.shape[1]), dim=-1).indices  # [B, k]
        nxt_index = start + best  # pool indices
        nxt_tok = child_tok.gather(1, best)
        parent = child_from.gather(1, best)  # [B, k] index in the frontier
        parent_feat = frontier_feat[rows[:, None], parent]  # [B, k, H]
        seen = frontier_seen.gather(1, parent[..., None].expand(-1, -1, frontier_seen.shape[2]))  # [B, k, D]
        mask = torch.cat([seen, itself[:, : best.shape[1], : best.shape[1]]], 2)  # [B, k, D + k]
        positions = (base + level - 1)[:, None].expand_as(nxt_tok)  # pair position = parent's position
        f_hat, logits = drafter(nxt_tok, parent_feat, positions, cache=cache, tree_mask=mask)
        frontier_feat, frontier_logits, frontier_seen = f_hat, logits, mask
        frontier_index, frontier_score = nxt_index, child_score.gather(1, best)
    cache.rollback(committed)
    return _select(torch.cat(pool_tokens, 1), torch.cat(pool_parent, 1), torch.cat(pool_score, 1),
                   torch.cat(pool_depth, 1), batch.last_tokens, strategy, torch.stack(q_rows, 1) if q_rows else None)


def _select(tokens, parents, scores, depth, root, strategy, q) -> Draft:
    """Keep the best verify_tokens nodes (all of a chain), ordered by depth, re-indexed with the root
    as node 0."""
    B, P = tokens.shape
    device = tokens.device
    keep = P if strategy.kind == "chain" else min(strategy.verify_tokens, P)
    chosen = scores.topk(keep, dim=-1).indices  # [B, keep]
    order = (depth.gather(1, chosen) * P + chosen).argsort(dim=-1)  # by depth, parents first
    chosen = chosen.gather(1, order)
    new_index = torch.full((B, P), -2, dtype=torch.long, device=device)
    new_index.scatter_(1, chosen, torch.arange(1, keep + 1, device=device).expand(B, keep))
    par = parents.gather(1, chosen)  # pool parent, -1 = root
    par = torch.where(par >= 0, new_index.gather(1, par.clamp(min=0)), torch.zeros_like(par))
    out_tokens = torch.cat([root[:, None], tokens.gather(1, chosen)], 1)
    out_parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=device), par], 1)
    out_depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), depth.gather(1, chosen)], 1)
    return Draft(out_tokens, out_parents, out_depth, torch.ones_like(out_tokens, dtype=torch.bool), q)
