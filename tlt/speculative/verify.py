"""Exact verification of drafts: the output distribution is the target's, whatever the drafter did.

Two schemes, both pure tensor functions:

walk (target-only, for deterministic candidates: tree and n-gram drafts). At a node with target
distribution p, draw x ~ p; if x is one of the node's children, accept it and move there, otherwise
emit x and stop; at a leaf, the draw is the bonus token. This is the recursive rejection rule for
candidates c1..cm (accept c with probability p(c), else zero p(c), renormalise, try the next, finally
sample the remainder) collapsed into its single draw: both emit x with probability p(x). Each emitted
token is drawn from p with the very uniform plain decoding would use for that position, so with equal
logits the output equals plain sampling token for token.

chain (speculative sampling, for drafts d_i sampled from the drafter's q_i): accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a draw from
normalise(max(p_i - q_i, 0)); if all k are accepted emit a bonus draw from p_k (Leviathan et al.,
Chen et al., 2023). Greedy rows use one-hot p and q, which makes both schemes "longest matching prefix
plus one token".
"""

from __future__ import annotations

import torch

from tlt.rollout import rng
from tlt.rollout.sampling import sample_from, warp_logprobs

NEG_INF = float("-inf")


def one_hot_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log of a point mass at the argmax: [N, V] with 0 at the argmax and -inf elsewhere."""
    out = torch.full_like(logits, NEG_INF, dtype=torch.float32)
    return out.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)


def walk(
    logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, batch, counters: torch.Tensor
) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """Target-only verification of a tree per row.
    logits: [B, N, V] target logits at each node (node 0 is the root: the pending token);
    tokens: [B, N] node tokens; parents: [B, N] parent node index (-1 for the root, -2 for padding);
    depth: [B, N] node depths. Returns per row: visited nodes (root first), emitted tokens, their
    log-probs (as plain decoding reports them).
    The draw at a node of depth d uses the uniform of the d-th token after the root, so every node's
    draw is made at once, before the walk: the walk itself only follows matching children."""
    B, N, V = logits.shape
    per_node = [t.repeat_interleave(N, 0) for t in (batch.temperature, batch.top_k, batch.top_p)]
    lp = warp_logprobs(logits.reshape(B * N, V), *per_node)  # [B*N, V]
    u = rng.uniform(batch.keys.repeat_interleave(N, 0), (counters[:, None] + depth).flatten())  # [B*N]
    x = torch.where(per_node[0] <= 0, lp.argmax(-1), sample_from(lp, u))  # [B*N] each node's draw
    x_lp = lp.gather(1, x[:, None])[:, 0]  # [B*N]
    draws, draw_lps = x.view(B, N).tolist(), x_lp.view(B, N).tolist()
    visited, emitted, logprobs = [], [], []
    for row_tokens, row_parents, row_draws, row_lps in zip(tokens.tolist(), parents.tolist(), draws, draw_lps):
        child: dict[tuple[int, int], int] = {}
        for j in range(N):  # (parent, token) -> the first such node
            child.setdefault((row_parents[j], row_tokens[j]), j)
        path, out, out_lp = [0], [], []
        while True:
            cur = path[-1]
            out.append(row_draws[cur])
            out_lp.append(row_lps[cur])
            nxt = child.get((cur, row_draws[cur]))
            if nxt is None:
                break
            path.append(nxt)
        visited.append(path)
        emitted.append(out)
        logprobs.append(out_lp)
    return visited, emitted, logprobs


def speculative_sample_chain(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u_accept: torch.Tensor, u_final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """p: [B, k+1, V] target probs at the k drafts and after them; q: [B, k, V] draft probs; draft: [B, k]
    tokens sampled from q; u_accept: [B, k], u_final: [B] uniforms. Returns (accepted count [B],
    final token [B]): drafts[:, :count] are kept, then the final token."""
    B, k, V = q.shape
    p_d = p[:, :k].gather(2, draft[..., None])[..., 0]  # [B, k] p_i(d_i)
    q_d = q.gather(2, draft[..., None])[..., 0]  # [B, k] q_i(d_i) > 0: d_i was drawn from q_i
    ok = u_accept * q_d < p_d  # [B, k] accept with probability min(1, p/q)
    count = ok.long().cumprod(1).sum(1)  # [B] accepted prefix length
    rows = torch.arange(B, device=p.device)
    at = count.clamp(max=k - 1)
    residual = (p[rows, at] - q[rows, at]).clamp(min=0)  # [B, V] max(p_i - q_i, 0) at the rejection
    # A zero residual means p_i = q_i, where rejection has probability 0; p keeps the draw well defined.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, at])
    final_dist = torch.where((count == k)[:, None], p[:, k], residual)  # [B, V]
    final = sample_from(final_dist.log(), u_final)  # log 0 = -inf: zero-mass tokens are never drawn
    return count, final
