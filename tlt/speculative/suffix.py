"""Model-free draft trees from a suffix automaton over a group's texts and the prompt's earlier responses.

A policy answers a prompt much as its G siblings do and much as it did an epoch earlier, so what followed
the current suffix in those texts is a good draft at no model cost. Where the n-gram drafter (ngram.py)
continues one most recent match of at most 4 tokens as a chain, this drafter finds the *longest* suffix
of the sequence that occurred anywhere before, counts every continuation that followed it, and
proposes a tree: branches where the sources disagree, the likelier continuations first.

The structure is a generalised suffix automaton (Blumer et al., 1985): its states are the classes of
substrings with the same set of end positions, so the continuations of a substring are the outgoing
transitions of its state, and the number of times token c followed it is the end-position count of
the state reached by c. Chosen over a depth-limited suffix trie because it has at most 2n states for
n tokens whatever the depth (a trie of depth D holds up to nD nodes), extends by one token in
amortised O(1), and the longest suffix of a text that has a continuation is found on the suffix-link
chain of the text's own last state, without re-reading the text. Counts are kept by walking that chain
on every insertion (each state on it gains the new end position); the walk is capped at `MAX_CHAIN`
states, which only leaves the counts of very short contexts low in very repetitive texts.

Texts are added online and interleaved (the G samples grow one step at a time): each text remembers its
last state, and extending from a state that already has the transition is the generalised
construction (the automaton of a trie of texts). The samples and the prompt's earlier responses all
start at the prompt's last state, so the prompt is counted once. Every state also counts its end
positions per source kind (prompt, history, samples), and remembers the text of the latest one: that
names where a draft token came from (the metrics), never what is drafted.

Drafting (`draft_tree`) is best-first: a node's score is the product of the conditional probabilities on
its path; the `budget` best nodes up to `max_depth` are kept. When several automata draft (the group's,
and a read-only one over the run's recent responses to any prompt, the window), at each node only those
with the longest matched context speak (tied ones averaged): a longer context is the better witness, and
counts after a shorter one are another distribution. Pooled, the window's counts after two tokens would
dilute the group's after twenty: a prompt's first rollout with a window of 64 responses to other bench
problems (the arithmetic facts they share) takes 4.60 tokens a row-step and 11.3 s with the longest context
alone, 2.80 and 21.1 s pooled, 1.88 and 17.8 s without the window (docs/results/README.md, "The window, and
more history"). A source's state follows the drafted path; where the path leaves what it has seen, it backs off
along suffix links (a shorter context) and drops out below `min_match` tokens, so another source may take
over there.

A raw frequency is a poor probability. On the bench policy (docs/results/README.md, "Calibrated suffix
drafts"), of the continuations the target could take (their parent accepted), one seen once with no other
after its context was taken 78% of the time, seen three times with no other 95%, seen once against one other
20% (its frequency says 50%), once against eight others 5%; and the same single continuation was taken 46%
of the time after a 2-3-token match, 97% after 64 tokens or more. `Calibration` learns the rate per (count of
the continuation, count of the others, matched length) from the run's own verifications, and the drafter
ranks and floors by it: a pruned draft then keeps the paths the target is likely to take.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from tlt.speculative.ngram import NgramIndex

PROMPT, HISTORY, SAMPLES = 0, 1, 2  # source kinds counted per state
KIND_NAMES = ("prompt", "history", "samples")
MAX_CHAIN = 256  # states a count walk visits at most per inserted token
DEPTH_PER_MATCHED_TOKEN = 1.0  # a match of L tokens earns a draft up to ceil(L * this) deep


class SuffixAutomaton:
    """States are indices; state 0 is the root (the empty string). Per state: `next` (token -> state),
    `link` (suffix link, -1 at the root), `length` (its longest string's length), `counts[kind]` (end
    positions from texts of that kind) and `recent` (text id of the newest end position)."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.counts: list[list[int]] = [[0] for _ in KIND_NAMES]
        self.recent: list[int] = [-1]
        self.tokens = 0  # tokens inserted

    def __len__(self) -> int:
        return len(self.length)

    @classmethod
    def of(cls, texts, kind: int = SAMPLES) -> "SuffixAutomaton":
        """The automaton of `texts` (token lists), each from the root, text ids 0, 1, ..."""
        sam = cls()
        for i, text in enumerate(texts):
            sam.insert(text, 0, i, kind)
        return sam

    def insert(self, tokens, state: int, text: int, kind: int) -> int:
        """Append `tokens` to the text whose last state is `state`; returns its new last state."""
        for token in tokens:
            state = self.extend(state, token, text, kind)
        return state

    def count(self, state: int) -> int:
        return sum(c[state] for c in self.counts)

    def extend(self, last: int, token: int, text: int, kind: int) -> int:
        """Append one token to a text whose last state is `last`; returns the text's new last state."""
        nxt, link, length = self.next, self.link, self.length
        q = nxt[last].get(token)
        if q is not None:  # the string is already present (another text had it): reuse or split its state
            cur = q if length[q] == length[last] + 1 else self._split(last, q, token)
        else:
            cur = self._state(length[last] + 1, {}, 0, None)
            p = last
            while p != -1 and token not in nxt[p]:
                nxt[p][token] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][token]
                link[cur] = q if length[p] + 1 == length[q] else self._split(p, q, token)
        v, steps = cur, 0
        counts = self.counts[kind]
        while v > 0 and steps < MAX_CHAIN:  # every suffix of the text gains this end position
            counts[v] += 1
            self.recent[v] = text
            v, steps = link[v], steps + 1
        self.tokens += 1
        return cur

    def _state(self, length: int, transitions: dict, link: int, like: int | None) -> int:
        self.next.append(transitions)
        self.link.append(link)
        self.length.append(length)
        for c in self.counts:
            c.append(c[like] if like is not None else 0)
        self.recent.append(self.recent[like] if like is not None else -1)
        return len(self.length) - 1

    def _split(self, p: int, q: int, token: int) -> int:
        """Split q: its strings of length <= length[p] + 1 move to a clone (which keeps q's end positions),
        and the transitions on `token` into q from p's suffix chain move to the clone."""
        clone = self._state(self.length[p] + 1, dict(self.next[q]), self.link[q], q)
        while p != -1 and self.next[p].get(token) == q:
            self.next[p][token] = clone
            p = self.link[p]
        self.link[q] = clone
        return clone

    def advance(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Matching an external text: (state, matched length) after reading `token`, where `matched` is the
        length of the longest suffix of the text read so far that occurs here, and `state` its state."""
        nxt, link = self.next, self.link
        while state > 0 and token not in nxt[state]:
            state = link[state]
            matched = self.length[state]
        if token in nxt[state]:
            return nxt[state][token], matched + 1
        return 0, 0

    def backoff(self, state: int, matched: int) -> tuple[int, int]:
        """The longest suffix (of the `matched` tokens ending at `state`) with a continuation: (state, length);
        (0, 0) when none but the empty one has one."""
        while state > 0 and not self.next[state]:
            state = self.link[state]
            matched = self.length[state]
        return (state, matched) if state > 0 else (0, 0)

    def nbytes(self) -> int:
        """Rough memory of the structure (Python object overhead included)."""
        return len(self) * 200 + sum(len(t) for t in self.next) * 80


@dataclass
class Source:
    """One automaton's view of a row: the state of its longest matched suffix and that length. `text` is
    the row's own text id in it (-1 when the row is not one of its texts)."""

    sam: SuffixAutomaton
    state: int
    matched: int
    text: int = -1
    kind_names: tuple[str, ...] = KIND_NAMES


def source_name(src: Source, state: int) -> str:
    """Where the continuation ending at `state` came from: the kind with the most end positions there;
    samples split into "self" (the newest was the row's own text) and "siblings"."""
    counts = [c[state] for c in src.sam.counts]
    kind = max(range(len(counts)), key=lambda k: (counts[k], -k))
    if kind == SAMPLES and src.kind_names[SAMPLES] == "samples":
        return "self" if src.sam.recent[state] == src.text else "siblings"
    return src.kind_names[kind]


CALIBRATION_CAP = 16  # counts a calibration key tells apart (min(count, CAP)), per side
MATCH_BUCKETS = 7  # matched lengths a calibration key tells apart: 1, 2-3, 4-7, ..., 32-63, 64 and more
PRIOR_WEIGHT = 4.0  # verifications a key's prior weighs as, in its estimate
CALIBRATION_HALVE = 4096  # a key's counts halve once it has seen this many parents accepted (tracks the policy)


def match_bucket(matched: int) -> int:
    """The calibration's bucket of a matched context length: floor(log2(matched)), capped."""
    return min(MATCH_BUCKETS - 1, max(matched, 1).bit_length() - 1)


class Calibration:
    """Acceptance of a suffix draft node given that its parent was accepted, per key: the count of its token
    after the context, the count of every other token after it (both capped at CALIBRATION_CAP) and the
    length of the longest matched context, in power-of-two buckets. The estimate is shrunk twice, each time
    with weight w = PRIOR_WEIGHT: per (count, others), (accepted + w f) / (reached + w) for the raw
    frequency f = count / (count + others); per (count, others, matched), the same with that estimate in
    place of f. So a key starts at the frequency and ends at its measured rate, and a rarely seen matched
    length borrows its counts' rate. Counts halve once a key has CALIBRATION_HALVE, so the table follows a
    policy that RL changes (the finer keys fill more slowly, so they halve later and follow a drift more
    slowly than their counts' keys do). It decides drafts only: verification is target-only, so the samples do
    not depend on it.

    The matched length matters as much as the counts: on the bench policy, a continuation seen once with
    no other after its context was taken 46% of the times its parent was after a 2-3-token match, 82% after
    8-15 tokens and 97% after 64 or more (docs/results/README.md, "The matched length in the calibration").

    It learns from every continuation the drafter weighed, drafted or not: at each node of the accepted
    path the target drew one token, so each candidate child of that node (kept or cut by the budget or the
    floor) would have been accepted exactly when it is that token. Learning only from drafted nodes would
    freeze a key whose estimate once fell under an arm's floor (never drafted again, never measured again)."""

    def __init__(self) -> None:
        self.table: dict[tuple[int, int], list[float]] = {}  # (count, others) -> [parents accepted, node accepted]
        self.by_match: dict[tuple[int, int, int], list[float]] = {}  # (count, others, match bucket) -> the same

    @staticmethod
    def key(count: int, mass: int, matched: int) -> tuple[int, int, int]:
        return min(count, CALIBRATION_CAP), min(mass - count, CALIBRATION_CAP), match_bucket(matched)

    def estimate(self, key: tuple[int, int, int], frequency: float) -> float:
        """The estimate of `key` (`Calibration.key`) for a continuation of raw `frequency`."""
        prior = self.counts_estimate(key, frequency)
        seen = self.by_match.get(key)
        return prior if seen is None else (seen[1] + PRIOR_WEIGHT * prior) / (seen[0] + PRIOR_WEIGHT)

    def counts_estimate(self, key: tuple[int, int, int], frequency: float) -> float:
        """The estimate of `key`'s (count, others) alone, the matched length left out."""
        seen = self.table.get(key[:2])
        return frequency if seen is None else (seen[1] + PRIOR_WEIGHT * frequency) / (seen[0] + PRIOR_WEIGHT)

    def view(self, by_match: bool) -> "Calibration | _CountsOnly":
        """What a draft ranks by: these estimates, or with by_match False the (count, others) ones alone."""
        return self if by_match else _CountsOnly(self)

    def record(self, candidates: dict[int, dict[int, tuple[int, int, int]]], path: list[int], emitted: list[int]) -> None:
        """Learn from one verified draft: candidates[n] maps each token the drafter weighed after node n (0:
        the root) to its key; `path` is the accepted path (root first) and emitted[j] the token the target
        drew at path[j]. Candidates after a rejected node tell nothing."""
        for node, drawn in zip(path, emitted):
            for token, key in candidates.get(node, {}).items():
                taken = token == drawn
                for table, k in ((self.table, key[:2]), (self.by_match, key)):
                    seen = table.setdefault(k, [0.0, 0.0])
                    seen[0] += 1
                    seen[1] += taken
                    if seen[0] >= CALIBRATION_HALVE:
                        seen[0] /= 2
                        seen[1] /= 2

    def state_dict(self) -> dict:
        return {"table": [[c, o, r, a] for (c, o), (r, a) in sorted(self.table.items())],
                "by_match": [[c, o, m, r, a] for (c, o, m), (r, a) in sorted(self.by_match.items())]}

    def load_state_dict(self, state: dict) -> None:
        """A state of `state_dict`. One without "by_match" (the counts-only format) loads with no matched-length
        keys: each starts at its counts' estimate."""
        table = {(int(c), int(o)): [float(r), float(a)] for c, o, r, a in state["table"]}
        by_match = {(int(c), int(o), int(m)): [float(r), float(a)] for c, o, m, r, a in state.get("by_match", [])}
        for entries in (table, by_match):
            bad = next((key for key, (r, a) in entries.items() if not 0 <= a <= r), None)
            if bad is not None:  # an estimate above 1 would break the drafts' best-first order
                raise ValueError(f"calibration key {bad}: accepted {entries[bad][1]} is not within "
                                 f"[0, reached {entries[bad][0]}]")
        self.table, self.by_match = table, by_match


class _CountsOnly:
    """A Calibration's estimates per (count, others), the matched length left out (strategy "-c1")."""

    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration

    def estimate(self, key: tuple[int, int, int], frequency: float) -> float:
        return self.calibration.counts_estimate(key, frequency)


def max_depth_for(matched: int, cap: int) -> int:
    """Draft depth a match of `matched` tokens earns: longer matches, deeper drafts."""
    return max(0, min(cap, math.ceil(matched * DEPTH_PER_MATCHED_TOKEN)))


def draft_tree(sources: list[Source], max_depth: int, budget: int, min_match: int = 1, floor: float = 0.0,
               scores: list[float] | None = None, calibration: Calibration | _CountsOnly | None = None,
               candidates: dict | None = None) -> tuple[list[int], list[int], list[str], int]:
    """The best `budget` continuation nodes up to `max_depth` deep, of those whose path score (the product
    of the conditional probabilities along it: the continuation frequencies after the longest matched context,
    averaged over the sources that match that long, or with `calibration` its estimates from those sources'
    summed counts) is at least `floor`. Returns (tokens,
    parents, names, matched): node i + 1 has token tokens[i] and parent parents[i] (0: the root, the row's
    last token), parents before children; names[i] is the node's source; matched is the longest match.
    Nodes come best score first; `scores`, when given, receives each node's, `candidates` per expanded
    node (0: the root) every continuation weighed after it, token -> calibration key (what
    `Calibration.record` learns from), kept or not."""
    start = []
    for src in sources:
        state, matched = src.sam.backoff(src.state, src.matched)
        if matched >= min_match:
            start.append((src, state, matched))
    longest = max((m for _, _, m in start), default=0)
    depth_cap = min(max_depth, max_depth_for(longest, max_depth))
    tokens, parents, names = [], [], []
    if not start or depth_cap == 0 or budget == 0:
        return tokens, parents, names, longest
    heap: list = []
    order = 0

    def push_children(node: int, depth: int, score: float, views: list) -> None:
        nonlocal order
        context = max(m for _, _, m in views)  # the longest matched context: it speaks alone (module docstring)
        views = [v for v in views if v[2] == context]
        merged: dict[int, list] = {}  # token -> [averaged probability, best (weight, src, child), count]
        total_mass = 0
        for src, state, _ in views:
            sam = src.sam
            children = sam.next[state]
            counts = {tok: sam.count(child) for tok, child in children.items()}
            mass = sum(counts.values())
            if mass == 0:
                continue
            total_mass += mass
            for tok, child in children.items():
                w = counts[tok] / mass / len(views)
                entry = merged.setdefault(tok, [0.0, (-1.0, None, 0), 0])
                entry[0] += w
                entry[2] += counts[tok]
                if w > entry[1][0]:
                    entry[1] = (w, src, child)
        weighed = candidates.setdefault(node, {}) if candidates is not None else None
        keyed = weighed is not None or calibration is not None
        for tok, (p, (_, src, child), count) in merged.items():
            order += 1
            if keyed:
                key = Calibration.key(count, total_mass, context)
                if weighed is not None:
                    weighed[tok] = key
                if calibration is not None:
                    p = calibration.estimate(key, count / total_mass)
            heapq.heappush(heap, (-score * p, order, node, depth + 1, tok, source_name(src, child)))

    views_of = {0: [(src, state, matched) for src, state, matched in start]}
    push_children(0, 0, 1.0, views_of[0])
    while heap and len(tokens) < budget and -heap[0][0] >= floor:  # a child scores at most its parent
        neg, _, parent, depth, tok, name = heapq.heappop(heap)
        if scores is not None:
            scores.append(-neg)
        tokens.append(tok)
        parents.append(parent)
        names.append(name)
        node = len(tokens)
        if depth >= depth_cap:
            continue
        views = []
        for src, state, matched in views_of[parent]:
            nstate, nmatched = src.sam.advance(state, matched, tok)
            nstate, nmatched = src.sam.backoff(nstate, nmatched)
            if nmatched >= min_match:
                views.append((src, nstate, nmatched))
        if views:
            views_of[node] = views
            push_children(node, depth, -neg, views)
    return tokens, parents, names, longest


class SuffixIndex:
    """A request group's drafting index: the prompt, its earlier responses (`history`) and the group's
    samples in one automaton, plus an optional shared read-only automaton over the run's recent
    responses (`window`). Texts are registered by `add` (the interface of NgramIndex, which this
    index also serves for the n-gram arms) and inserted lazily, at the next suffix draft: an adaptive
    engine that rarely picks a suffix arm pays nothing per plain step."""

    def __init__(self, prompt: list[int], history=(), window: SuffixAutomaton | None = None,
                 min_match: int = 1) -> None:
        self.ngram = NgramIndex(prompt)
        self.prompt, self.history, self.window, self.min_match = list(prompt), list(history), window, min_match
        self.sam: SuffixAutomaton | None = None  # built at the first suffix draft
        self.prompt_state = 0
        # id(text) -> [text, text id, last state, tokens inserted, window state, window matched, tokens read]
        self._texts: dict[int, list] = {}
        self._grown: list[list] = []  # entries of texts that grew since the last catch-up

    def add(self, text: list[int], old_length: int) -> None:
        """`text` (a sample's prompt + tokens, a list that only grows) grew from old_length tokens."""
        self.ngram.add(text, old_length)
        entry = self._texts.get(id(text))
        if entry is None:
            entry = self._texts[id(text)] = [text, 1 + len(self.history) + len(self._texts), None, len(self.prompt),
                                             0, 0, 0]
        self._grown.append(entry)

    def propose(self, text: list[int], depth: int) -> list[int]:
        """The n-gram drafter's chain (ngram.NgramIndex.propose)."""
        return self.ngram.propose(text, depth)

    def _catch_up(self) -> None:
        if self.sam is None:
            self.sam = SuffixAutomaton()
            self.prompt_state = self.sam.insert(self.prompt, 0, 0, PROMPT)
            for i, response in enumerate(self.history):
                self.sam.insert(response, self.prompt_state, 1 + i, HISTORY)
        grown, self._grown = self._grown, []
        for entry in grown:
            if entry[2] is None:  # a sample's text starts with the prompt, already in
                entry[2] = self.prompt_state
            text, tid, state, done = entry[0], entry[1], entry[2], entry[3]
            if done < len(text):
                entry[2] = self.sam.insert(text[done:], state, tid, SAMPLES)
                entry[3] = len(text)
            if self.window is not None and entry[6] < len(text):
                ws, wm = entry[4], entry[5]
                for tok in text[entry[6]:]:
                    ws, wm = self.window.advance(ws, wm, tok)
                entry[4], entry[5], entry[6] = ws, wm, len(text)

    def sources(self, text: list[int]) -> list[Source]:
        """The automata's views of the row whose text is `text` (registered by `add`)."""
        self._catch_up()
        entry = self._texts.get(id(text))
        if entry is None:  # not registered: match it as an external text
            state, matched = 0, 0
            for tok in text:
                state, matched = self.sam.advance(state, matched, tok)
            out = [Source(self.sam, state, matched)]
        else:
            out = [Source(self.sam, entry[2], self.sam.length[entry[2]], entry[1])]
        if self.window is not None and entry is not None:
            out.append(Source(self.window, entry[4], entry[5], -1, ("window",) * len(KIND_NAMES)))
        return out

    def tree(self, text: list[int], max_depth: int, budget: int, floor: float = 0.0,
             calibration: Calibration | _CountsOnly | None = None, candidates: dict | None = None
             ) -> tuple[list[int], list[int], list[str], int]:
        """draft_tree over this row's sources."""
        return draft_tree(self.sources(text), max_depth, budget, self.min_match, floor, None, calibration, candidates)
