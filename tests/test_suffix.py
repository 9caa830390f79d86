"""The suffix automaton and its draft trees, against brute-force matchers over random token streams."""

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from tlt.speculative.suffix import (CALIBRATION_HALVE, HISTORY, PRIOR_WEIGHT, PROMPT, SAMPLES, Calibration, Source,
                                   SuffixAutomaton, SuffixIndex, draft_tree, match_bucket)

def probability(cal: Calibration, count: int, mass: int, matched: int) -> float:
    """The calibration's estimate for a continuation seen `count` times of `mass` after `matched` tokens, as the
    drafter asks for it (draft_tree: key, then estimate from the raw frequency)."""
    return cal.estimate(Calibration.key(count, mass, matched), count / mass)


streams = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=4)


def occurrences(texts, s):
    """End positions (text, i) of substring s: text[i - len(s):i] == s."""
    return [(t, i) for t, text in enumerate(texts) for i in range(len(s), len(text) + 1) if text[i - len(s):i] == s]


def state_of(sam, s):
    state = 0
    for tok in s:
        state = sam.next[state].get(tok)
        if state is None:
            return None
    return state


def substrings(texts, longest=5):
    return {tuple(text[i:j]) for text in texts for i in range(len(text)) for j in range(i + 1, min(len(text), i + longest) + 1)}


@settings(max_examples=40, deadline=None)
@given(streams)
def test_every_substring_is_recognised_with_its_count_and_continuations(texts):
    sam = SuffixAutomaton.of(texts)
    for s in substrings(texts):
        state = state_of(sam, s)
        assert state is not None
        assert sam.count(state) == len(occurrences(texts, list(s)))
        followers = {}
        for t, i in occurrences(texts, list(s)):
            if i < len(texts[t]):
                followers[texts[t][i]] = followers.get(texts[t][i], 0) + 1
        assert {tok: sam.count(child) for tok, child in sam.next[state].items()} == followers
    assert state_of(sam, [9]) is None  # a token never seen is no substring
    assert len(sam) <= 2 * max(1, sum(map(len, texts)))


@settings(max_examples=40, deadline=None)
@given(streams, st.lists(st.integers(0, 4), max_size=25))
def test_advance_tracks_the_longest_suffix_that_occurs(texts, query):
    sam = SuffixAutomaton.of(texts)
    state, matched = 0, 0
    for n in range(1, len(query) + 1):
        state, matched = sam.advance(state, matched, query[n - 1])
        brute = max((k for k in range(n + 1) if k == 0 or occurrences(texts, query[n - k:n])), default=0)
        assert matched == brute
        assert state == (state_of(sam, query[n - matched:n]) if matched else 0)


@settings(max_examples=30, deadline=None)
@given(streams, st.randoms(use_true_random=False))
def test_interleaved_insertion_equals_one_text_at_a_time(texts, rnd):
    """The group's samples grow a step at a time, interleaved: the automaton must be that of the texts."""
    sam, last, done = SuffixAutomaton(), [0] * len(texts), [0] * len(texts)
    while any(d < len(t) for d, t in zip(done, texts)):
        i = rnd.choice([i for i, t in enumerate(texts) if done[i] < len(t)])
        k = rnd.randint(1, 3)
        last[i] = sam.insert(texts[i][done[i]:done[i] + k], last[i], i, SAMPLES)
        done[i] = min(len(texts[i]), done[i] + k)
    ref = SuffixAutomaton.of(texts)
    for s in substrings(texts):
        assert sam.count(state_of(sam, s)) == ref.count(state_of(ref, s))
        assert set(sam.next[state_of(sam, s)]) == set(ref.next[state_of(ref, s)])
    for i, text in enumerate(texts):  # each text's last state holds the whole text
        assert sam.length[last[i]] == len(text)


@settings(max_examples=40, deadline=None)
@given(streams, st.integers(1, 6), st.integers(1, 12))
def test_draft_tree_continues_the_longest_matched_suffix(texts, depth, budget):
    own = texts[0]
    sam = SuffixAutomaton.of(texts)
    last = state_of(sam, own) if own else 0
    tokens, parents, names, matched = draft_tree([Source(sam, last, len(own), 0)], depth, budget)
    # The longest suffix of `own` that is followed by something somewhere (brute force).
    followed = [k for k in range(1, len(own) + 1)
                if any(i < len(texts[t]) for t, i in occurrences(texts, own[len(own) - k:]))]
    assert matched == (max(followed) if followed else 0)
    assert len(tokens) <= budget and all(p <= i for i, p in enumerate(parents))
    node_depth = [0]
    for p in parents:
        node_depth.append(node_depth[p] + 1)
    assert max(node_depth) <= min(depth, matched)
    assert len(set(zip(parents, tokens))) == len(tokens)  # no two siblings share a token
    if matched:
        context = own[len(own) - matched:]
        firsts = {texts[t][i] for t, i in occurrences(texts, context) if i < len(texts[t])}
        assert {tok for tok, p in zip(tokens, parents) if p == 0} <= firsts
        # The first node is the most frequent continuation of the match.
        counts = {tok: sum(1 for t, i in occurrences(texts, context) if i < len(texts[t]) and texts[t][i] == tok)
                  for tok in firsts}
        assert counts[tokens[0]] == max(counts.values())
    assert set(names) <= {"self", "siblings"}


def test_a_repeated_history_is_drafted_whole_in_one_chain():
    prompt = [1, 2, 3, 4, 5]  # matched with the first token: 6 tokens, which earn a 6-deep draft
    history = [[7, 8, 9, 10, 11, 12, 13, 14]]
    index = SuffixIndex(prompt, history=history)
    text = prompt + [7]
    index.add(text, len(prompt))
    tokens, parents, names, matched = index.tree(text, 16, 32)
    assert tokens == [8, 9, 10, 11, 12, 13] and parents == [0, 1, 2, 3, 4, 5]
    assert names == ["history"] * 6 and matched == len(prompt) + 1


def test_sources_disagreeing_make_branches_ordered_by_frequency():
    prompt = [5]
    index = SuffixIndex(prompt, history=[[1, 2, 3], [1, 2, 4], [1, 2, 4]])
    text = prompt + [1, 2]
    index.add(text, len(prompt))
    tokens, parents, names, _ = index.tree(text, 4, 8)
    assert tokens[:2] == [4, 3] and parents[:2] == [0, 0]  # 4 followed twice, 3 once


def test_a_floor_keeps_the_nodes_the_sources_agree_on():
    """With a floor, the draft holds the nodes whose path frequency reaches it: 4 follows [1, 2] in two of
    three histories, 3 in one."""
    prompt = [5]
    index = SuffixIndex(prompt, history=[[1, 2, 3], [1, 2, 4], [1, 2, 4]])
    text = prompt + [1, 2]
    index.add(text, len(prompt))
    assert index.tree(text, 4, 8, floor=0.5)[:2] == ([4], [0])
    assert index.tree(text, 4, 8, floor=0.3)[:2] == ([4, 3], [0, 0])
    assert index.tree(text, 4, 8, floor=0.7)[0] == []



def test_calibration_starts_at_the_frequency_and_learns_from_every_weighed_continuation():
    cal = Calibration()
    assert probability(cal, 1, 1, 5) == 1.0 and probability(cal, 1, 4, 5) == 0.25  # nothing verified yet
    # (count, others, matched length bucket), capped
    assert Calibration.key(3, 4, 1) == (3, 1, 0) and Calibration.key(40, 50, 7) == (16, 10, 2)
    assert [match_bucket(m) for m in (1, 2, 3, 4, 63, 64, 10_000)] == [0, 1, 1, 2, 5, 6, 6]
    # after the root the drafter weighed 7 (key (1, 0, 2)); after node 1 (rejected), 8: the target drew 9 at the root
    for _ in range(12):
        cal.record({0: {7: (1, 0, 2)}, 1: {8: (1, 0, 2)}}, [0], [9])
    assert cal.table == {(1, 0): [12.0, 0.0]} and cal.by_match == {(1, 0, 2): [12.0, 0.0]}  # nothing after a rejection
    counts_only = PRIOR_WEIGHT / (12 + PRIOR_WEIGHT)
    assert probability(cal, 1, 1, 4) == pytest.approx(PRIOR_WEIGHT * counts_only / (12 + PRIOR_WEIGHT))
    assert probability(cal, 1, 1, 64) == pytest.approx(counts_only)  # a matched length never verified: its counts' rate
    counts = cal.view(False)  # "-c1": the matched length left out
    assert counts.estimate(Calibration.key(1, 1, 4), 1.0) == pytest.approx(counts_only)
    # 5 (3 of 4 times) was drafted and taken; 6 (1 of 4) was weighed and not drafted: both are learned
    for _ in range(12):
        cal.record({0: {5: (3, 1, 0), 6: (1, 3, 0)}}, [0, 1], [5, 2])
    assert counts.estimate(Calibration.key(3, 4, 1), 0.75) == pytest.approx((12 + PRIOR_WEIGHT * 0.75) / (12 + PRIOR_WEIGHT))
    assert counts.estimate(Calibration.key(1, 4, 1), 0.25) == pytest.approx(PRIOR_WEIGHT * 0.25 / (12 + PRIOR_WEIGHT))
    # after a long match, 1 of 2 was taken every time: that key's rate, not its counts' (1 of 2 after short matches)
    for _ in range(40):
        cal.record({0: {3: (1, 1, 6), 4: (1, 1, 6)}}, [0], [3])
        cal.record({0: {3: (1, 1, 1), 4: (1, 1, 1)}}, [0], [5])
    assert probability(cal, 1, 2, 100) > 0.45 > probability(cal, 1, 2, 2)
    other = Calibration()
    other.load_state_dict(cal.state_dict())
    assert other.table == cal.table and other.by_match == cal.by_match
    older = Calibration()  # a state written before the matched length was kept
    older.load_state_dict({"table": cal.state_dict()["table"]})
    assert older.table == cal.table and older.by_match == {}
    with pytest.raises(ValueError, match=r"calibration key \(1, 1, 6\)"):
        older.load_state_dict({"table": [], "by_match": [[1, 1, 6, 2.0, 3.0]]})
    for _ in range(CALIBRATION_HALVE):  # a key halves its counts as it fills: it follows a changing policy
        cal.record({0: {4: (2, 2, 3)}}, [0], [4])
    assert cal.table[(2, 2)] == [CALIBRATION_HALVE / 2] * 2 == cal.by_match[(2, 2, 3)]


def test_a_calibrated_tree_ranks_and_floors_by_the_measured_acceptance():
    """4 follows [1, 2] in two histories of three, 3 in one: by frequency 4 comes first; once verification
    has shown that a continuation seen twice against one other is rarely taken and one seen once against two
    mostly is, 3 comes first, and a floor of 0.5 keeps 3 alone."""
    prompt = [5]
    index = SuffixIndex(prompt, history=[[1, 2, 3], [1, 2, 4], [1, 2, 4]])
    text = prompt + [1, 2]
    index.add(text, len(prompt))
    weighed = {}
    assert index.tree(text, 4, 8, candidates=weighed)[:2] == ([4, 3], [0, 0])
    # the root's continuations (after a match of the 3 tokens [5, 1, 2]); its children's have none to weigh
    assert weighed[0] == {4: (2, 1, 1), 3: (1, 2, 1)}
    cal = Calibration()
    for _ in range(40):
        cal.record(weighed, [0, 2], [3, 9])
    assert index.tree(text, 4, 8, calibration=cal)[:2] == ([3, 4], [0, 0])
    assert index.tree(text, 4, 8, floor=0.5, calibration=cal)[:2] == ([3], [0])


def test_a_calibrated_tree_follows_the_rates_of_its_own_matched_length():
    """The same two continuations after a 3-token match (bucket 1) and after a long one (bucket 6): 3 is taken
    after short matches, 4 after long ones. Drafting after the 3-token match ranks by bucket 1's rates; the
    counts-only view, which pools both, ranks by the counts (4, seen twice, first)."""
    prompt = [5]
    index = SuffixIndex(prompt, history=[[1, 2, 3], [1, 2, 4], [1, 2, 4]])
    text = prompt + [1, 2]
    index.add(text, len(prompt))
    cal = Calibration()
    for _ in range(40):
        cal.record({0: {4: (2, 1, 1), 3: (1, 2, 1)}}, [0], [3])
        cal.record({0: {4: (2, 1, 6), 3: (1, 2, 6)}}, [0], [4])
    assert index.tree(text, 4, 8, calibration=cal)[0] == [3, 4]
    assert index.tree(text, 4, 8, calibration=cal.view(False))[0] == [4, 3]


def test_deeper_draft_nodes_are_keyed_by_their_longer_matches():
    index = SuffixIndex([5], history=[[1, 2, 3, 6, 7, 8, 9]])
    text = [5, 1, 2]
    index.add(text, 1)
    weighed = {}
    tokens, parents = index.tree(text, 8, 8, candidates=weighed)[:2]
    assert tokens == [3, 6, 7] and parents == [0, 1, 2]  # a 3-token match earns 3 levels
    # after [5, 1, 2] (3 tokens matched) bucket 1; each drafted token lengthens the match: 4-7 tokens, bucket 2
    assert weighed == {0: {3: (1, 0, 1)}, 1: {6: (1, 0, 2)}, 2: {7: (1, 0, 2)}}

@settings(max_examples=60, deadline=None)
@given(streams, st.integers(1, 6), st.floats(0.01, 0.99))
def test_a_floor_keeps_exactly_the_nodes_scoring_at_least_it(texts, depth, floor):
    """Without a budget to cut it, a floored tree holds every node of the whole tree whose path score reaches
    the floor and no other: nodes come best first, and a child never scores above its parent (which a
    stop at the first node under the floor relies on)."""
    own = texts[0]
    sam = SuffixAutomaton.of(texts)
    last = state_of(sam, own) if own else 0
    sources = [Source(sam, last, len(own), 0)]
    scores, cut_scores = [], []
    whole = draft_tree(sources, depth, 10_000, scores=scores)
    cut = draft_tree(sources, depth, 10_000, floor=floor, scores=cut_scores)
    assert all(0 < s <= 1 + 1e-12 for s in scores)
    assert all(scores[i] <= scores[p - 1] + 1e-12 for i, p in enumerate(whole[1]) if p)  # child <= parent
    assert scores == sorted(scores, reverse=True)
    kept = [i for i, s in enumerate(scores) if s >= floor]
    assert cut[0] == [whole[0][i] for i in kept] and cut[1] == [whole[1][i] for i in kept]
    assert cut_scores == [scores[i] for i in kept] and cut[3] == whole[3]



@settings(max_examples=60, deadline=None)
@given(streams, st.integers(1, 6), st.floats(0.01, 0.99), st.integers(0, 2**32 - 1))
def test_a_calibrated_floor_keeps_exactly_the_nodes_scoring_at_least_it(texts, depth, floor, seed):
    """The same with a calibration table of random rates: its estimates stay within [0, 1], so a child never
    scores above its parent and the floored tree is the whole one cut at the floor."""
    rnd = random.Random(seed)
    cal = Calibration()
    for count in range(1, 6):
        for others in range(0, 6):
            reached = rnd.randint(1, 50)
            cal.table[(count, others)] = [float(reached), float(rnd.randint(0, reached))]
            for bucket in range(3):
                reached = rnd.randint(1, 50)
                cal.by_match[(count, others, bucket)] = [float(reached), float(rnd.randint(0, reached))]
    own = texts[0]
    sam = SuffixAutomaton.of(texts)
    last = state_of(sam, own) if own else 0
    sources = [Source(sam, last, len(own), 0)]
    scores, cut_scores = [], []
    whole = draft_tree(sources, depth, 10_000, scores=scores, calibration=cal)
    cut = draft_tree(sources, depth, 10_000, floor=floor, scores=cut_scores, calibration=cal)
    assert all(0 <= s <= 1 + 1e-12 for s in scores)
    assert all(scores[i] <= scores[p - 1] + 1e-12 for i, p in enumerate(whole[1]) if p)
    assert scores == sorted(scores, reverse=True)
    kept = [i for i, s in enumerate(scores) if s >= floor]
    assert cut[0] == [whole[0][i] for i in kept] and cut[1] == [whole[1][i] for i in kept]

def test_per_kind_counts_name_the_source():
    sam = SuffixAutomaton()
    p = sam.insert([1, 2], 0, 0, PROMPT)
    sam.insert([3, 4], p, 1, HISTORY)
    sam.insert([3, 5], p, 2, SAMPLES)
    state = state_of(sam, [1, 2, 3])
    assert [c[state] for c in sam.counts] == [0, 1, 1]
    assert [c[state_of(sam, [2])] for c in sam.counts] == [1, 0, 0]


def test_self_matches_and_the_window_draft_as_their_sources():
    window = SuffixAutomaton.of([[40, 41, 42, 43]])
    index = SuffixIndex([9], window=window)
    text = [9, 20, 21, 22, 20, 21]
    index.add(text, 1)
    tokens, _, names, _ = index.tree(text, 3, 3)
    assert tokens == [22, 20] and names == ["self"] * 2  # a 2-token match earns a 2-deep draft
    other = [9, 40, 41]
    index.add(other, 1)
    tokens, _, names, _ = index.tree(other, 4, 4)
    assert tokens == [42, 43] and names == ["window", "window"]


def test_only_the_longest_matched_context_drafts():
    """A window whose match is shorter than the group's adds no branch and no counts (its continuations follow
    another context); where the window's match is the longer, it drafts alone; tied matches are averaged."""
    window = SuffixAutomaton.of([[3, 5]] * 10 + [[7, 8, 2, 3, 6]])
    index = SuffixIndex([9, 1, 2, 3, 4], window=window)
    text = [9, 1, 2, 3, 4, 1, 2, 3]  # the group (its prompt) matches 1 2 3 -> 4; the window 2 3 -> 6, or 3 -> 5
    index.add(text, 5)
    tokens, parents, names, matched = index.tree(text, 1, 4)
    assert (tokens, names, matched) == ([4], ["prompt"], 3)
    scores = []
    draft_tree(index.sources(text), 1, 4, scores=scores)
    assert scores == [1.0]  # pooled with the window's 5 and 6 it would have been 4 / 5 at most
    other = [9, 1, 2, 3, 4, 7, 8, 2, 3]  # the window matches 7 8 2 3 (4 tokens), the group 2 3 (2)
    index.add(other, 5)
    tokens, _, names, _ = index.tree(other, 1, 4)
    assert (tokens, names) == ([6], ["window"])
    tied = SuffixIndex([9, 1, 2, 5], window=SuffixAutomaton.of([[1, 2, 6]]))
    row = [9, 1, 2, 5, 1, 2]  # both match 1 2 (2 tokens)
    tied.add(row, 4)
    scores = []
    tokens, _, _, _ = draft_tree(tied.sources(row), 1, 4, scores=scores)
    assert sorted(tokens) == [5, 6] and scores == [0.5, 0.5]


def test_a_random_group_drafts_fast_enough():
    """Drafting must stay small next to a decode step: 8 rows x 200 steps on a 4-token alphabet."""
    import time

    rng = random.Random(0)
    prompt = [rng.randrange(4) for _ in range(20)]
    index = SuffixIndex(prompt, history=[[rng.randrange(4) for _ in range(200)]] * 4)
    texts = [list(prompt) for _ in range(8)]
    start = time.perf_counter()
    for step in range(200):
        for t in texts:
            old = len(t)
            t.append(rng.randrange(4))
            index.add(t, old)
            index.tree(t, 8, 16)
    assert time.perf_counter() - start < 5.0
