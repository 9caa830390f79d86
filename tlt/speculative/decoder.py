"""Speculative decoding inside the rollout engine.

A step is draft -> verify -> commit:
  - draft: the strategy proposes a token tree per live row (speculative/tree.py: the learned drafter's
    EAGLE-2 tree or chain; speculative/ngram.py: suffix matches; speculative/suffix.py: frequency-weighted
    trees from the group and the prompt's earlier responses, or per row the learned tree under "hybrid");
  - verify: one target forward over root + draft with the tree's ancestor mask, at positions
    n + depth; verify.walk (trees, n-gram chains, suffix trees) or verify.speculative_sample_chain (sampled chains)
    picks the accepted path and one more token, exactly from the target's distribution;
  - commit: the target cache keeps only the accepted path (KVCache.compact); the accepted tokens'
    log-probs and features come from the verification forward.

The drafter's own state follows the accepted tokens in `DraftState`: its KV cache holds the pairs
(f[t], x[t+1]) it has consumed; pairs produced since (by prefill, verification or plain steps) wait in
`pending` and are consumed by the next draft's first drafter forward. So a batch can switch from plain
decoding to speculation at any step without re-running the target: the features were computed anyway.
After a long run of plain steps a row has many pairs pending, and consuming them all would make the
first drafting step cost as much as many plain steps, and the adaptive tuner would judge the drafter
arms by that one step. `catch_up_window` bounds it: the drafter consumes the newest pairs of each row
only and the older ones stay out of its cache, a gap in what its attention sees (positions stay exact;
the target features it reads carry the whole context), which costs hardly any acceptance at the default
window of 16. The older pairs are dropped as plain steps go (`DraftState.bound`), so pending holds at most
about twice the window a row. `drafter_window` bounds what the drafter's attention reads likewise: once a row's drafter
cache holds twice the window, it keeps the newest `drafter_window` pairs (`DraftState.trim`, positions
unchanged). At large batch and long contexts the drafter's single layer reads as much cache per call as a
target layer does, several calls a step. tlt trains drafters within a window of each record (512 pairs
for `tlt train-drafter`, 256 online; the drafter's config records it as `train_window`), so a window
within it also keeps the drafter's attention where it was trained: on the bench policy's 16 x 8 rollout
a window of 128 accepted 3.75 tokens a step against 3.63 with the whole context
(docs/results/bench_rollout_amx_drafter_window.json). The engine's default, "auto", is a quarter of the
recorded window (`auto_window`). Verification does not depend on the drafter, so neither window changes the output.
Strategy "off" is plain decoding that still feeds `pending`, the arm the adaptive tuner can pick.

The decoder implements rollout.decoding.Decoder. Its per-row state lives where the engine carries it
without reading it: each sequence's `RowDraft` (the group's drafting index, the row's text so far and
its acceptance counters) in `Sequence.state`, and the batch's `DraftState` in `LiveBatch.state`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tlt.errors import ConfigError
from tlt.rollout import rng
from tlt.rollout.config import EngineConfig
from tlt.rollout.decoding import DecodeResult, sample_next, stacked_layers
from tlt.rollout.sampling import warp_logprobs
from tlt.rollout.sequence import Sequence
from tlt.speculative.cost import StepCosts, power_of_two_bucket
from tlt.speculative.drafter import Drafter, check_tensors
from tlt.speculative.strategy import Strategy
from tlt.speculative.suffix import Calibration, SuffixAutomaton, SuffixIndex
from tlt.speculative.tree import chain_draft, expand, list_draft, node_depths
from tlt.speculative.verify import one_hot_logprobs, speculative_sample_chain, walk


MIN_PENDING = 8  # pending slots allocated at least, per row


@dataclass
class RowDraft:
    """Per sequence: its group's drafting index (shared by the group's rows), the row's text so far
    (prompt + tokens: one list that only grows, as the index requires) and its verification steps and
    the tokens they emitted (acceptance length = tokens / steps)."""

    index: SuffixIndex
    text: list[int] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0


class DraftState:
    """Per live row: the drafter's KV cache and the (target feature, token) pairs it has not consumed
    yet, right-padded: features [B, M, H], tokens [B, M] (M: capacity, at least the largest count),
    `count` [B] pairs per row, the first of them at position `start` [B] (pairs of a row are
    consecutive)."""

    def __init__(self, cache, features: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
                 start: torch.Tensor) -> None:
        self.cache, self.features, self.tokens, self.count, self.start = cache, features, tokens, count, start

    def add(self, features: torch.Tensor, tokens: torch.Tensor, k: torch.Tensor, position: torch.Tensor) -> None:
        """Append k[b] pairs per row (features [B, K, H], tokens [B, K]); `position` [B] is where they
        start, used when the row had nothing pending."""
        B, K = tokens.shape
        if self.tokens.shape[1] == 0:
            # Nothing pending in any row (every speculative step): the new pairs become the buffer as they
            # are. Its width is the largest count, so the next add grows it and never writes into it.
            self.features, self.tokens = features.to(self.features.dtype), tokens
            self.count, self.start = k, position
            return
        width = int(self.count.max()) + K
        if width > self.tokens.shape[1]:
            # Geometric growth: plain steps add a pair per row every step, and growing by exactly what
            # is needed would copy the whole pending buffer each time (quadratic in the run of steps).
            grow = max(width, 2 * self.tokens.shape[1], MIN_PENDING) - self.tokens.shape[1]
            self.features = torch.cat([self.features, self.features.new_zeros(B, grow, self.features.shape[2])], 1)
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(B, grow)], 1)
        # All K slots after each row's pairs are written; those past its k[b] pairs are not counted.
        # Indexed writes of whole feature rows: a scatter over the expanded index goes element by element
        # (32 rows x 5 pairs of 2,304 values: 0.60 ms in float32 and 69 ms in bf16, against 0.16 and 0.18).
        slot = self.count[:, None] + torch.arange(K, device=tokens.device)  # [B, K]
        rows = torch.arange(B, device=tokens.device)[:, None].expand(B, K)
        self.features[rows, slot] = features.to(self.features.dtype)
        self.tokens[rows, slot] = tokens
        self.start = torch.where(self.count == 0, position, self.start)
        self.count = self.count + k

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)
        used = int(self.count[rows].max()) if len(rows) else 0  # the copy leaves spare capacity behind
        self.features, self.tokens = self.features[rows, :used], self.tokens[rows, :used]
        self.count, self.start = self.count[rows], self.start[rows]

    def extend(self, *others: "DraftState") -> None:
        from tlt.model.kv_cache import KVCache

        states = [self, *others]
        self.cache = KVCache.concat([s.cache for s in states])
        width = max(s.tokens.shape[1] for s in states)
        self.features = torch.cat([_widen(s.features, width) for s in states])
        self.tokens = torch.cat([_widen(s.tokens, width) for s in states])
        self.count, self.start = torch.cat([s.count for s in states]), torch.cat([s.start for s in states])

    def bound(self, window: int) -> None:
        """Keep each row's newest `window` pending pairs (at most) once the buffer is wider than twice that:
        `take(window)` reads no more than those, so what it returns does not change. Without it a run of plain
        steps grows the buffer by a pair per row a step, and every row removal (`select`) copies all of it."""
        if self.tokens.shape[1] <= 2 * window:  # a host int: no tensor op on most steps
            return
        kept = self.count.clamp(max=window)
        skip = self.count - kept  # [B] the oldest pairs of each row, dropped
        index = (skip[:, None] + torch.arange(window, device=skip.device)).clamp(max=self.tokens.shape[1] - 1)
        rows = torch.arange(len(index), device=index.device)[:, None]  # whole feature rows, as in `add`
        self.features, self.tokens = self.features[rows, index], self.tokens[rows, index]
        self.start, self.count = self.start + skip, kept

    def trim(self, window: int) -> None:
        """Rows whose drafter cache holds more than 2 x `window` pairs keep their newest `window` (their
        keys carry their positions, so nothing else changes); the others are left as they are. Trimming at
        twice the window moves each pair about once per `window` steps."""
        if self.cache.max_length <= 2 * window:  # a host int: no tensor op on the steps that trim nothing
            return
        lengths = self.cache.lengths
        over = lengths > 2 * window
        keep = (lengths - window).clamp(min=0)[:, None] + torch.arange(window, device=lengths.device)  # [B, W]
        self.cache.compact(torch.where(over, 0, lengths), keep, torch.where(over, window, 0))

    def take(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor | None, torch.Tensor]:
        """The pending pairs (features [B, M, H], tokens [B, M], positions [B, M], valid [B, M] or None
        when every row has M pairs, count [B]), at most the last `window` of each row (None: all);
        pending is emptied."""
        M = int(self.count.max())
        if window is None or M <= window:
            count, arange = self.count, torch.arange(M, device=self.count.device)
            out = (self.features[:, :M], self.tokens[:, :M], self.start[:, None] + arange)
        else:
            count = self.count.clamp(max=window)
            skip = self.count - count  # [B] the oldest pairs of each row, left out
            arange = torch.arange(window, device=self.count.device)
            index = (skip[:, None] + arange).clamp(max=self.tokens.shape[1] - 1)  # [B, window]
            rows = torch.arange(len(index), device=index.device)[:, None]  # whole feature rows, as in `add`
            out = (self.features[rows, index], self.tokens[rows, index], (self.start + skip)[:, None] + arange)
        uniform = len(count) == 1 or int(count.min()) == len(arange)
        self.features, self.tokens = self.features[:, :0], self.tokens[:, :0]
        self.count = torch.zeros_like(self.count)
        return *out, None if uniform else arange[None] < count[:, None], count


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad dim 1 of t ([B, M] or [B, M, H]) to `width`."""
    shape = list(t.shape)
    shape[1] = width - shape[1]
    return torch.cat([t, t.new_zeros(shape)], 1)


def drafter_for(config: EngineConfig, model) -> Drafter | None:
    """EngineConfig.drafter as a Drafter (one given as such, or loaded from a folder or "default"),
    drafting on weights of `config.drafter_bits` (`Drafter.set_weight_bits`)."""
    drafter = config.drafter
    if drafter is None:
        return None
    if not isinstance(drafter, Drafter):
        drafter = Drafter.load(drafter, model)
    if drafter.weight_bits != config.drafter_bits:
        drafter.set_weight_bits(config.drafter_bits)
    return drafter


def auto_window(train_window: int | None) -> int | None:
    """drafter_window "auto" for a drafter trained over `train_window` pairs: a quarter of it, so the
    drafter attends over a quarter to a half of what it was trained over (None: the whole context). On
    the bench policy's rollout a quarter (128 of 512) accepted 3.99 tokens a step and a half 3.90, and ran
    1.12x against 1.05x plain decoding (docs/results/bench_rollout_amx_drafter_1500.json)."""
    return max(1, train_window // 4) if train_window else None


def window_for(window: int | str | None, drafter: Drafter | None) -> int | None:
    """EngineConfig.drafter_window as the decoder applies it: "auto" is `auto_window` of the window the
    drafter's config records (None without a drafter or a record)."""
    if window != "auto":
        return window
    return auto_window(drafter.config.train_window if drafter is not None else None)


class SpeculativeDecoder:
    tuner = None

    def __init__(self, model, drafter=None, strategy: Strategy | None = None,
                 catch_up_window: int | None = None, drafter_window: int | str | None = None,
                 measure_costs: bool = False, cost_buckets=power_of_two_bucket) -> None:
        self.model, self.drafter, self.catch_up_window = model, drafter, catch_up_window
        self.drafter_window = window_for(drafter_window, drafter)
        self.strategy = strategy or Strategy()
        if self.strategy.uses_drafter and drafter is None:
            raise ValueError(f"strategy {self.strategy.name} needs a drafter")
        self.output_layers = tuple(drafter.output_layers) if drafter is not None else ()
        # What fraction of suffix draft nodes verification accepts, learned from every suffix draft it
        # verifies (suffix.Calibration): kept for the engine's life, across rollouts, as the tuner is.
        self.calibration = Calibration()
        # seconds per verified token, per live-batch bucket (cost_buckets: batch size -> bucket, an adaptive engine's
        # tuner's): the floor of "-pa" suffix drafts, measured only for them
        self.costs = StepCosts(cost_buckets) if measure_costs or self.strategy.auto_floor else None

    @classmethod
    def from_config(cls, model, config: EngineConfig) -> "SpeculativeDecoder":
        """The decoder of speculative="on": every step drafts with `config.strategy`."""
        return cls(model, drafter_for(config, model), Strategy.of(config.strategy), config.catch_up_window,
                   config.drafter_window)

    # --- engine hooks (rollout.decoding.Decoder) ---------------------------------------------------
    def start(self, prompts: list[list[int]], samples: list[int], history) -> list[list[RowDraft]]:
        """One drafting index per prompt (its earlier responses from `history` in it), shared by its rows;
        the run's recent responses (`history.window`) in one automaton shared by all."""
        window = SuffixAutomaton.of(history.window) if history is not None and history.window else None
        out = []
        for i, (prompt, n) in enumerate(zip(prompts, samples)):
            index = SuffixIndex(prompt, history.responses[i] if history is not None else (), window)
            out.append([RowDraft(index, list(prompt)) for _ in range(n)])
        return out

    def appended(self, seqs: list[Sequence], kept: list[int]) -> None:
        for seq, k in zip(seqs, kept):
            row = seq.state
            old = len(row.text)
            row.text += seq.tokens[len(seq.tokens) - k :]
            row.index.add(row.text, old)

    def acceptance_length(self, seq: Sequence) -> float | None:
        return seq.state.tokens / seq.state.steps if seq.state.steps else None

    def load_drafter(self, state: dict[str, torch.Tensor]) -> None:
        if self.drafter is None:
            raise ConfigError("load_drafter: the engine has no learned drafter (speculative off or n-gram only)")
        check_tensors(state, self.drafter.state_dict(), "load_drafter")
        with torch.no_grad():
            for name, tensor in self.drafter.state_dict().items():
                tensor.copy_(state[name])

    def prefill(self, batch, ids: torch.Tensor, lengths: torch.Tensor, out, counts: torch.Tensor) -> None:
        """Give freshly prefilled rows their draft state: the prompt pairs are consumed once per group
        (then the drafter cache is forked like the target's); the pair of each sample's first token
        waits in pending."""
        if self.drafter is None:
            return
        feats = self.drafter.target_features(out.hidden_states, out.layer_states)  # [G, T, H]
        G, T = ids.shape
        cache = self.drafter.new_cache(G, block=batch.cache.block, limit=batch.cache.limit)
        if T > 1:
            valid = torch.arange(T - 1, device=ids.device)[None] < (lengths - 1)[:, None]  # [G, T-1]
            positions = torch.arange(T - 1, device=ids.device).expand(G, T - 1)
            self.drafter(ids[:, 1:], feats[:, :-1], positions, cache=cache, attention_mask=valid)
        cache.fork(counts)
        rows = torch.arange(G, device=ids.device)
        last = feats[rows, lengths - 1].repeat_interleave(counts, 0)  # [N, H]
        pos = (lengths - 1).repeat_interleave(counts, 0)  # [N]
        batch.state = DraftState(cache, last[:, None], batch.last_tokens[:, None].clone(),
                                 torch.ones_like(pos), pos)

    def decode(self, batch, strategy: Strategy | None = None) -> DecodeResult:
        """One step of `strategy` (default: the decoder's own), timed (`DecodeResult.seconds`, what the tuner
        rewards). With `costs` (an engine with a "-pa" arm), the cost of a model-free step (plain, n-gram, suffix)
        is recorded there, which sets the floor of auto-pruned suffix drafts (cost.py); a learned drafter's step
        also pays its forwards and catch-up, which a fit on verified tokens would charge to them."""
        strategy = strategy or self.strategy
        start = time.perf_counter()
        result = self._plain(batch) if strategy.kind == "off" else self._speculate(batch, strategy)
        result.seconds = time.perf_counter() - start
        if self.costs is not None and not strategy.uses_drafter:
            rows = len(result.tokens)
            self.costs.record(rows, rows + result.drafted, sum(map(len, result.tokens)), result.seconds)
        return result

    def _speculate(self, batch, strategy: Strategy) -> DecodeResult:
        names = weighed = None  # per row, each draft node's source and what the suffix drafter weighed
        if strategy.kind == "ngram":
            proposals = [s.state.index.propose(s.state.text, strategy.depth) for s in batch.seqs]
            draft = chain_draft(batch.last_tokens, proposals)
        elif strategy.uses_history:
            draft, names, weighed = self._suffix_draft(batch, strategy)
        else:
            draft = self._learned_draft(batch, strategy)
        result = self._verify(batch, draft)
        result.strategy = strategy.name
        result.drafted = int(draft.valid[:, 1:].sum())
        if names is not None:
            result.sources = credit_sources(names, result.visited, result.tokens)
            for candidates, path, emitted in zip(weighed, result.visited, result.tokens):
                if candidates is not None:
                    self.calibration.record(candidates, path, emitted)
        return result

    def _learned_draft(self, batch, strategy: Strategy):
        if self.drafter_window is not None:
            batch.state.trim(self.drafter_window)
        f0, logits0 = self._catch_up(batch)
        return expand(self.drafter, batch.state.cache, f0, logits0, batch.cache.lengths, strategy, batch)

    def _suffix_draft(self, batch, strategy: Strategy):
        """Suffix trees per row (suffix.py); under "hybrid", rows whose suffix tree is no deeper than the
        strategy's depth take the learned drafter's tree instead (one drafter pass for the batch)."""
        hybrid = strategy.kind == "hybrid"
        depth = strategy.verify_tokens if hybrid else strategy.depth
        floor = self.costs.floor(len(batch)) if strategy.auto_floor else strategy.prune / 100
        calibration = self.calibration.view(strategy.calibrated == 2) if strategy.calibrated else None
        # per sampled row, the continuations weighed after each node (what the calibration learns from);
        # greedy rows (evaluations) take other paths than sampling and teach it nothing
        weighed: list = [{} if t > 0 else None for t in batch.temperature.tolist()]
        trees = [s.state.index.tree(s.state.text, depth, strategy.verify_tokens, floor, calibration, w)
                 for s, w in zip(batch.seqs, weighed)]
        rows = [(tokens, parents) for tokens, parents, _, _ in trees]
        names = [n for _, _, n, _ in trees]
        # a row whose suffix tree (as its match and floor leave it) is no deeper than the learned one's
        short = {b for b, (_, parents) in enumerate(rows) if max(node_depths(parents)) <= strategy.depth} if hybrid else set()
        if short:
            learned = self._learned_draft(batch, strategy.learned_tree)
            tokens, parents = learned.tokens[:, 1:].tolist(), learned.parents[:, 1:].tolist()
            kept = learned.valid[:, 1:].sum(1).tolist()  # a pruned row's kept nodes come first
            for b in short:
                rows[b] = (tokens[b][:kept[b]], parents[b][:kept[b]])
                names[b] = ["drafter"] * kept[b]
        for b in short:  # a hybrid's learned rows
            weighed[b] = None
        return list_draft(batch.last_tokens, rows), names, weighed

    # --- steps -------------------------------------------------------------------------------------
    def _plain(self, batch) -> DecodeResult:
        base = batch.cache.lengths.clone()
        out = self.model(batch.last_tokens[:, None], cache=batch.cache, output_layers=self.output_layers)
        layers = stacked_layers(out, self.output_layers) if batch.wants_hidden else None
        result = sample_next(batch, out.logits[:, 0], out.hidden_states[:, 0], None if layers is None else layers[:, 0])
        self._feed(batch, out, torch.tensor(result.tokens, device=base.device), torch.ones_like(base), base)
        return result

    def _catch_up(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Consume pending pairs (the last `catch_up_window` of each row); return the drafter's feature
        and logits after each row's last pair."""
        feats, tokens, positions, valid, counts = batch.state.take(self.catch_up_window)
        f_hat, logits = self.drafter(tokens, feats, positions, cache=batch.state.cache, attention_mask=valid)
        rows = torch.arange(len(counts), device=counts.device)
        return f_hat[rows, counts - 1], logits[rows, counts - 1]

    def _verify(self, batch, draft) -> DecodeResult:
        base = batch.cache.lengths.clone()  # [B] the root's position
        positions = base[:, None] + draft.depth  # [B, N]
        mask = None if bool(draft.valid.all()) else draft.valid
        out = self.model(draft.tokens, attention_mask=mask, position_ids=positions, cache=batch.cache,
                         tree_mask=draft.ancestors, output_layers=self.output_layers)
        counters = batch.counters
        if draft.q is None:
            visited, emitted, logprobs = walk(out.logits, draft.tokens, draft.parents, draft.depth, batch, counters)
        else:
            visited, emitted, logprobs = self._verify_chain(out.logits, draft, batch, counters)
        K = max(map(len, visited))
        padded = [(v + [0] * (K - len(v)), e + [0] * (K - len(e))) for v, e in zip(visited, emitted)]
        keep, tokens = torch.tensor(padded, device=base.device).unbind(1)  # [B, K] each: path nodes, their tokens
        counts = torch.tensor([len(v) for v in visited], device=base.device)  # [B]
        batch.cache.compact(base, keep, counts)
        self._feed(batch, out, tokens, counts, base, keep)
        for seq, e in zip(batch.seqs, emitted):
            seq.state.steps += 1
            seq.state.tokens += len(e)
        hidden = layers = None
        if batch.wants_hidden:
            hidden = [out.hidden_states[b, v] for b, v in enumerate(visited)]
            stacked = stacked_layers(out, self.output_layers)
            layers = [stacked[b, v] for b, v in enumerate(visited)] if stacked is not None else None
        return DecodeResult(emitted, logprobs, hidden, layers=layers, visited=visited)

    def _verify_chain(self, logits, draft, batch, counters):
        B, N, V = logits.shape
        k = N - 1
        flat = logits.reshape(B * N, V)
        per_node = [t.repeat_interleave(N, 0) for t in (batch.temperature, batch.top_k, batch.top_p)]
        lp = warp_logprobs(flat, *per_node).view(B, N, V)  # [B, k+1, V] warped target log-probs
        greedy = batch.temperature <= 0
        p = torch.where(greedy[:, None, None], one_hot_logprobs(logits), lp).exp()  # [B, k+1, V]
        drafts = draft.tokens[:, 1:]  # [B, k]
        q = torch.where(greedy[:, None, None], torch.nn.functional.one_hot(drafts, V).float(), draft.q)
        u_accept = torch.stack([rng.uniform(batch.keys, counters + i, stream=1) for i in range(k)], 1)
        count, final = speculative_sample_chain(p, q, drafts, u_accept, rng.uniform(batch.keys, counters, stream=2))
        visited, emitted, logprobs = [], [], []
        for b, (c, f) in enumerate(zip(count.tolist(), final.tolist())):
            toks = drafts[b, :c].tolist() + [f]
            visited.append(list(range(c + 1)))
            emitted.append(toks)
            logprobs.append(lp[b, torch.arange(c + 1), torch.tensor(toks)].tolist())
        return visited, emitted, logprobs

    def _feed(self, batch, out, tokens: torch.Tensor, counts: torch.Tensor, base: torch.Tensor,
              nodes: torch.Tensor | None = None) -> None:
        """Queue the new (feature, token) pairs for the drafter: the feature of the forward `out` at node
        nodes[b, j] (at position j when None) produced tokens[b, j], for j < counts[b] (tokens and nodes
        [B, K], counts and base [B]: the first pair's position)."""
        if self.drafter is None:
            return
        feats = self.drafter.target_features(out.hidden_states, out.layer_states)  # [B, N, H]
        if nodes is not None:
            feats = feats[torch.arange(len(nodes), device=nodes.device)[:, None], nodes]  # [B, K, H]
        batch.state.add(feats, tokens, counts, base)
        if self.catch_up_window is not None:
            batch.state.bound(self.catch_up_window)


def credit_sources(names: list[list[str]], visited: list[list[int]], emitted: list[list[int]]) -> dict:
    """Per draft source, [row-steps, tokens emitted, draft tokens accepted] of one step. A row-step is
    credited to the source of its first accepted draft node (of its first proposed node when none was
    accepted; "none" for an empty draft); accepted draft tokens go to each node's own source."""
    out: dict[str, list[int]] = {}
    for row_names, path, tokens in zip(names, visited, emitted):
        lead = row_names[path[1] - 1] if len(path) > 1 else (row_names[0] if row_names else "none")
        entry = out.setdefault(lead, [0, 0, 0])
        entry[0] += 1
        entry[1] += len(tokens)
        for node in path[1:]:
            out.setdefault(row_names[node - 1], [0, 0, 0])[2] += 1
    return out
