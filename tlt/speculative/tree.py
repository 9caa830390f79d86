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
kept set always contains its ancestors. The drafter's cache then forgets the draft slots (KVCache.retract).
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
        # reach[i, j]: j is i or i's parent; its 2^m-th boolean power reaches 2^m levels up, so
        # ceil(log2(depth)) squarings cover the deepest node (2 products for a depth-4 tree instead of
        # one pass of five operators per level).
        reach = torch.zeros(B, N, N + 1, dtype=torch.bool, device=device)
        reach.scatter_(2, (self.parents + 1).clamp(min=0)[..., None], True)  # column 0: no parent
        reach = reach[..., 1:] | torch.eye(N, dtype=torch.bool, device=device)
        levels = int(self.depth.max()) if N else 0
        span = 1
        while span < levels:
            reach = torch.bmm(reach.float(), reach.float()) > 0
            span *= 2
        return reach


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


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth, the root's (0) first, of a tree given as parents (node i + 1's parent; 0: the
    root), parents listed before their children."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth


def list_draft(root: torch.Tensor, rows: list[tuple[list[int], list[int]]]) -> Draft:
    """A tree per row from token lists (suffix and hybrid drafts), right-padded: row b's node i + 1 has
    token rows[b][0][i] and parent rows[b][1][i] (0: the root), parents listed before their children."""
    B = root.shape[0]
    N = 1 + max((len(tokens) for tokens, _ in rows), default=0)
    tokens = [[0] * N for _ in range(B)]
    parents = [[-1] + [-2] * (N - 1) for _ in range(B)]
    depth = [[0] * N for _ in range(B)]
    for b, (toks, pars) in enumerate(rows):
        tokens[b][1 : 1 + len(toks)], parents[b][1 : 1 + len(pars)] = toks, pars
        depth[b][: 1 + len(pars)] = node_depths(pars)
    device = root.device
    tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)
    tokens_t[:, 0] = root
    parents_t = torch.tensor(parents, dtype=torch.long, device=device)
    return Draft(tokens_t, parents_t, torch.tensor(depth, dtype=torch.long, device=device), parents_t > -2)


def expand(drafter, cache, f0: torch.Tensor, logits0: torch.Tensor, base: torch.Tensor, strategy, batch) -> Draft:
    """Draft from the drafter's state. f0 [B, H], logits0 [B, V]: its output after the root (the
    feature f_hat at the root's position and the distribution of the next token); base [B]: the root's
    position. Chains sample from the warped q (stream 3) so that speculative sampling can use q."""
    B = f0.shape[0]
    device = f0.device
    chain = strategy.kind == "chain"
    k = 1 if chain else strategy.topk
    # Pool of proposed nodes (excluding the root), filled level by level: level 1 holds k nodes, every
    # later level k * k (the k children of each of the k frontier nodes), so a node's depth follows
    # from its pool index and pool order is depth order.
    pool_tokens, pool_parent, pool_score, q_rows = [], [], [], []
    frontier_feat = f0[:, None]  # [B, 1, H]
    frontier_logits = logits0[:, None]  # [B, 1, V]
    frontier_index = torch.full((B, 1), -1, device=device, dtype=torch.long)  # pool index, -1 = root
    frontier_score = torch.zeros(B, 1, device=device)
    # What each frontier node sees among the draft slots already in the drafter cache (its ancestors):
    # [B, F, D]. A child sees what its parent saw plus the parent's own slot, so the tree mask of the
    # next drafter call is its parents' rows of the last call's mask, then the new nodes themselves.
    frontier_seen = torch.zeros(B, 1, 0, dtype=torch.bool, device=device)
    itself = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    root_position = base[:, None].expand(B, k)  # [B, k] a frontier pair sits at its parent's position
    pooled = written = 0  # nodes in the pool, draft slots written to the drafter cache
    for level in range(1, strategy.depth + 1):
        if chain:
            lp = warp_logprobs(frontier_logits[:, 0], batch.temperature, batch.top_k, batch.top_p)  # [B, V]
            u = rng.uniform(batch.keys, batch.counters + level, stream=3)
            tok = torch.where(batch.temperature > 0, sample_from(lp, u), lp.argmax(-1))
            q_rows.append(lp.exp())
            child_tok = tok[:, None]  # [B, 1]
            child_score = frontier_score + lp.gather(1, tok[:, None])
        else:
            lp = frontier_logits.log_softmax(-1, dtype=torch.float32)  # [B, F, V]
            top_lp, top_tok = lp.topk(k, dim=-1)  # [B, F, k]
            child_score = (frontier_score[..., None] + top_lp).flatten(1)  # [B, F*k]
            child_tok = top_tok.flatten(1)  # child j of the frontier descends from frontier node j // k
        pool_tokens.append(child_tok)
        pool_parent.append(frontier_index.repeat_interleave(k, 1))
        pool_score.append(child_score - 1e-6 * level)
        if level == strategy.depth:
            break
        # The next frontier: the k best children, run through the drafter.
        frontier_score, best = child_score.topk(k, dim=-1)  # [B, k] (a level has F * k >= k children)
        if below_floor(frontier_score, strategy):
            break
        nxt_tok = child_tok.gather(1, best)
        parent = best // k  # [B, k] index in the frontier
        rows = torch.arange(B, device=device)[:, None]  # whole rows by index (a gather goes element by element)
        parent_feat = frontier_feat[rows, parent]  # [B, k, H]
        seen = frontier_seen[rows, parent]  # [B, k, D]
        mask = torch.cat([seen, itself], 2)  # [B, k, D + k]
        positions = root_position if level == 1 else root_position + (level - 1)
        f_hat, logits = drafter(nxt_tok, parent_feat, positions, cache=cache, tree_mask=mask)
        frontier_feat, frontier_logits, frontier_seen = f_hat, logits, mask
        frontier_index = pooled + best  # pool indices
        pooled += child_tok.shape[1]
        written += k
    cache.retract(written)
    depth = torch.tensor([lv + 1 for lv, t in enumerate(pool_tokens) for _ in range(t.shape[1])], device=device)
    return _select(torch.cat(pool_tokens, 1), torch.cat(pool_parent, 1), torch.cat(pool_score, 1),
                   depth.expand(B, -1), batch.last_tokens, strategy, torch.stack(q_rows, 1) if q_rows else None)


def below_floor(frontier_score: torch.Tensor, strategy) -> bool:
    """Whether every row's frontier lies under a pruned tree's floor: so then does every node a deeper
    level could add (a node scores below its parent), none of which the draft would keep, so the
    expansion stops there, a drafter call saved per level left."""
    return bool(strategy.prune) and bool((frontier_score < strategy.floor).all())


def _select(tokens, parents, scores, depth, root, strategy, q) -> Draft:
    """Keep the best verify_tokens nodes (all of a chain), ordered by depth, re-indexed with the root
    as node 0. The pool is in depth order (see `expand`), so sorting by pool index orders by depth.
    With `strategy.prune`, of those only the nodes whose path score is at least log(prune / 100) stay, in
    the same order, and the rest of a row is right-aligned padding (a row may keep none). A node's score
    is its parent's plus a log-probability, less a tie-break per level, so it is below its parent's: the
    kept nodes of a row hold their ancestors, as the best verify_tokens do."""
    B, P = tokens.shape
    device = tokens.device
    keep = P if strategy.kind == "chain" else min(strategy.verify_tokens, P)
    chosen = scores.topk(keep, dim=-1).indices.sort(dim=-1).values  # [B, keep] parents first
    kept = None  # unpruned: every chosen node
    if strategy.prune:
        kept = scores.gather(1, chosen) >= strategy.floor
        order = ((~kept).long() * (P + 1) + chosen).argsort(dim=1)  # kept nodes first, each part in pool order
        chosen, kept = chosen.gather(1, order), kept.gather(1, order)
        keep = int(kept.sum(1).max())
        chosen, kept = chosen[:, :keep], kept[:, :keep]
    # Column 0 stands for the root (pool parent -1), column j + 1 for pool node j: its new index.
    new_index = torch.zeros(B, P + 1, dtype=torch.long, device=device)
    new_index.scatter_(1, chosen + 1, torch.arange(1, keep + 1, device=device).expand(B, keep))
    par = new_index.gather(1, parents.gather(1, chosen) + 1)  # [B, keep] new parent index, 0 = root
    chosen_depth = depth.gather(1, chosen)
    if kept is not None:  # padding: no parent, depth 0
        par, chosen_depth = par.masked_fill(~kept, -2), chosen_depth.masked_fill(~kept, 0)
    out_tokens = torch.cat([root[:, None], tokens.gather(1, chosen)], 1)
    out_parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=device), par], 1)
    out_depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), chosen_depth], 1)
    valid = torch.ones_like(out_tokens, dtype=torch.bool)
    if kept is not None:
        valid[:, 1:] = kept
    return Draft(out_tokens, out_parents, out_depth, valid, q)
