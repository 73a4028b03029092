"""NgramProposer (spec/ngram.py): prompt lookup, longest suffix first, latest occurrence."""

from __future__ import annotations

import pytest

from tokenmill.spec import NgramProposer, create_proposer


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = NgramProposer(num_tokens=3, ngram_min=2, ngram_max=3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 5, 6]
    # Suffix [5, 6] (3-gram [4, 5, 6] never occurred): latest earlier match at 5 -> 7, 3, 4.
    assert proposer.propose_tokens(tokens) == [7, 3, 4]


def test_prefers_the_longest_matching_suffix() -> None:
    proposer = NgramProposer(num_tokens=2, ngram_min=1, ngram_max=3)
    # [8, 9] occurs last at 4 (-> 1, 2); the 3-gram [7, 8, 9] occurs at 0 (-> 3, 8).
    tokens = [7, 8, 9, 3, 8, 9, 1, 2, 7, 8, 9]
    assert proposer.propose_tokens(tokens) == [3, 8]


def test_cuts_at_the_end_of_the_context_and_finds_nothing_without_a_match() -> None:
    proposer = NgramProposer(num_tokens=4, ngram_min=2, ngram_max=2)
    assert proposer.propose_tokens([1, 2, 9, 1, 2]) == [9, 1, 2]
    assert proposer.propose_tokens([1, 2, 3, 4, 5]) == []
    assert proposer.propose_tokens([1]) == []
    assert NgramProposer(4, 3, 3).propose_tokens([1, 2, 3, 1, 2]) == []  # no 3-gram repeats


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="speculative_method must be ngram"):
        create_proposer("medusa", 3)
