"""The model-free drafter's index: longest suffix match over the prompt, the sequence and its siblings."""

from tlt.speculative.ngram import NgramIndex


def test_proposes_the_continuation_of_a_sibling_sample():
    prompt = [1, 2, 3]
    index = NgramIndex(prompt, max_n=3)
    sibling = prompt + [7, 8, 9, 10, 11]
    index.add(sibling, len(prompt))
    mine = prompt + [7, 8]
    index.add(mine, len(prompt))
    # The longest suffix (3, 7, 8) last occurred in the sibling, followed by 9, 10, 11.
    assert index.propose(mine, 4) == [9, 10, 11]


def test_prefers_the_longest_match_and_the_most_recent_occurrence():
    index = NgramIndex([5, 1, 2, 6, 1, 2, 7], max_n=2)
    assert index.propose([9, 1, 2], 1) == [7]  # (1, 2) last seen before 7
    assert index.propose([9, 9, 5], 2) == [1, 2]  # only the unigram (5) matches


def test_a_loop_in_the_sequence_itself_continues_as_an_overlapping_copy():
    text = [4, 5, 6, 4, 5, 6, 4]
    index = NgramIndex([], max_n=3)
    index.add(text, 0)
    assert index.propose(text, 7) == [5, 6, 4, 5, 6, 4, 5]


def test_no_match_proposes_nothing():
    assert NgramIndex([1, 2, 3]).propose([8, 9], 4) == []


def test_indexing_at_lookup_gives_the_table_of_indexing_on_arrival():
    """Tokens are indexed lazily, at the next lookup; replayed in arrival order, the table (and so every
    proposal) equals that of an index that looked up after every arrival."""
    import random

    def table(index, texts):  # the table with each text named by its row ("prompt" for the prompt)
        names = {id(t): row for row, t in enumerate(texts)} | {id(index.prompt): "prompt"}
        return {key: (names[id(text)], end) for key, (text, end) in index.table.items()}

    rng = random.Random(0)
    prompt = [rng.randrange(6) for _ in range(12)]
    eager, lazy = NgramIndex(prompt), NgramIndex(prompt)
    eager_texts, lazy_texts = [list(prompt) for _ in range(4)], [list(prompt) for _ in range(4)]
    for step in range(60):
        for row in range(4):
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            for index, texts in ((eager, eager_texts), (lazy, lazy_texts)):
                old = len(texts[row])
                texts[row] += new
                index.add(texts[row], old)
            eager.propose(eager_texts[row], 4)  # looks up after every arrival: indexes it at once
        if step % 20 == 19:
            assert lazy._log and not eager._log
            assert [lazy.propose(t, 5) for t in lazy_texts] == [eager.propose(t, 5) for t in eager_texts]
            assert table(lazy, lazy_texts) == table(eager, eager_texts)
