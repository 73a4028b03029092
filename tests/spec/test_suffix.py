"""SuffixProposer (spec/suffix.py): the longest suffix match in the request's context or in the
ring of finished outputs, its most frequent continuation, as long as it stays likely."""

from __future__ import annotations

import pytest

from tokenmill.sampling_params import SamplingParams
from tokenmill.spec import Draft, DraftRequest, SuffixProposer, create_proposer


def ask(proposer: SuffixProposer, req_id: str, token_ids: list[int], num_prompt: int) -> dict:
    """One propose() call for one request (as the runner makes it)."""
    return proposer.propose([DraftRequest(req_id, token_ids, num_prompt, SamplingParams(), None)])


def finished(proposer: SuffixProposer, req_id: str, prompt: list[int], output: list[int]) -> None:
    """A request the proposer saw once, finished with ``output``."""
    ask(proposer, req_id, prompt, len(prompt))
    proposer.finish(req_id, output)


def test_proposes_the_continuation_of_a_match_in_its_own_context() -> None:
    proposer = SuffixProposer(num_tokens=3)
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    # [5, 6, 7] ended at 2 (match_len 3, so up to 3 tokens): what followed it.
    assert proposer.propose_tokens(tokens) == [8, 9, 1]
    # The last token itself is no occurrence: a lone repeat ([1, 2, 1] has 1 at 0) is needed.
    assert proposer.propose_tokens([1, 2, 1]) == [2]
    # A continuation that runs into the end of the context stops there: [1, 2] at 1 -> 9, 1, 2.
    assert SuffixProposer(5, max_spec_factor=4.0).propose_tokens([1, 2, 9, 1, 2]) == [9, 1, 2]
    assert ask(proposer, "r", tokens, 2) == {"r": Draft([8, 9, 1])}


def test_matches_the_longest_suffix_up_to_max_depth() -> None:
    #        0  1  2  3  4  5  6  7
    tokens = [1, 2, 7, 3, 2, 8, 1, 2]
    # [1, 2] ended at 1 (-> 7, 3); [2] alone ended at 1 and 4 (-> 7 or 8, the latest: 8).
    assert SuffixProposer(num_tokens=4).propose_tokens(tokens) == [7, 3]
    assert SuffixProposer(num_tokens=4, max_depth=1).propose_tokens(tokens) == [8]
    # A match does not run off the start: [1, 1] has no earlier occurrence (the one "ending at
    # 0" would wrap around); [1] ended at 0 and 2 -> 5 or 1, the later.
    assert SuffixProposer(num_tokens=4).propose_tokens([1, 5, 1, 1]) == [1]


def test_finished_outputs_are_matched_but_not_their_prompts() -> None:
    proposer = SuffixProposer(num_tokens=4)
    # Prompt [40, 41, 42], output [1, 2, 3, 4, 5]; nothing to propose while it ran.
    assert ask(proposer, "a", [40, 41, 42], 3) == {}
    proposer.finish("a", [1, 2, 3, 4, 5])
    # [1, 2] (match_len 2) is only in the store: its next 2 tokens.
    assert ask(proposer, "b", [9, 1, 2], 3) == {"b": Draft([3, 4])}
    # The prompt was not stored: [40, 41] would otherwise continue with 42.
    assert ask(proposer, "c", [8, 40, 41], 3) == {}


def test_the_most_frequent_continuation_wins_over_the_latest() -> None:
    proposer = SuffixProposer(num_tokens=4)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 7, 1, 2, 7, 1, 2, 8, 3, 1, 2]
    # [1, 2] ended at 1, 4, 7 -> 7, 7, 8: 7 (p 2/3), then both of its occurrences -> 1.
    # (Prompt lookup would take the latest occurrence: 8.)
    assert proposer.propose_tokens(tokens) == [7, 1]
    # Only the occurrences that went on with the chosen token go on: [1] at 0, 3, 6 -> 7, 7, 8;
    # then 3 or 5 (the later, 5; counting 6's 4 too would make it a three-way tie won by 4).
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 7, 3, 1, 7, 5, 1, 8, 4, 9, 1]
    assert SuffixProposer(num_tokens=4, max_spec_factor=2.0).propose_tokens(tokens) == [7, 5]
    # In the store: three outputs after [1, 2], 3 twice and 4 once; each ends there.
    for rid, output in [("a", [1, 2, 3]), ("b", [1, 2, 3]), ("c", [1, 2, 4])]:
        finished(proposer, rid, [0], output)
    assert proposer.propose_tokens([9, 1, 2]) == [3]


def test_equally_frequent_continuations_go_to_the_most_recent() -> None:
    proposer = SuffixProposer(num_tokens=4)
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 1, 5, 6, 2, 0, 5, 6]
    # [5, 6] ended at 1 (-> 1) and 4 (-> 2): a tie, the later occurrence's 2 (not the smaller
    # id 1); then 0. Score 0.5 + 0.5.
    assert proposer.propose_tokens(tokens) == [2, 0]
    # A store output with a certain continuation of [5, 6] scores 1 + 1 and wins.
    finished(proposer, "a", [0], [7, 5, 6, 4, 4])
    assert proposer.propose_tokens(tokens) == [4, 4]


def test_equal_scores_go_to_the_own_context() -> None:
    proposer = SuffixProposer(num_tokens=4)
    finished(proposer, "a", [0], [3, 5, 6, 1, 2, 3])
    # [3, 5, 6] in both sources, certain continuations of 3 tokens each: the context's.
    assert proposer.propose_tokens([3, 5, 6, 9, 3, 5, 6]) == [9, 3, 5]


def test_proposal_length_follows_the_match_length() -> None:
    # [1] matched alone (match_len 1): 1 token, or ceil(3.0 * 1) = 3 with max_spec_factor 3.
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    assert SuffixProposer(num_tokens=5).propose_tokens(tokens) == [2]
    assert SuffixProposer(num_tokens=5, max_spec_factor=3.0).propose_tokens(tokens) == [2, 3, 4]
    # [1, 2] matched (match_len 2): 2 tokens; num_tokens caps a long match.
    assert SuffixProposer(num_tokens=5).propose_tokens([*tokens, 2]) == [3, 4]
    assert SuffixProposer(num_tokens=2).propose_tokens([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5]


def test_a_split_continuation_stops_below_min_token_prob() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [0, 7, 8, 1, 2, 0, 7, 8, 1, 3, 0, 7, 8]
    # [0, 7, 8] ended at 2 and 7: both -> 1 (p 1), then 2 or 3 (p 0.5): stops at 0.6 ...
    assert SuffixProposer(num_tokens=4, min_token_prob=0.6).propose_tokens(tokens) == [1]
    # ... goes on at 0.5, with the later occurrence's 3 and what followed it (p 0.5 * 1).
    assert SuffixProposer(num_tokens=4, min_token_prob=0.5).propose_tokens(tokens) == [1, 3, 0]
    # In the store: after [1, 2] one output goes on with 3 and one ends, which counts (p 0.5).
    proposer = SuffixProposer(num_tokens=4, min_token_prob=0.6)
    finished(proposer, "a", [0], [1, 2, 3])
    finished(proposer, "b", [0], [1, 2])
    assert proposer.propose_tokens([9, 1, 2]) == []
    # A 50/50 split at the first token: nothing.
    assert SuffixProposer(num_tokens=4, min_token_prob=0.6).propose_tokens([1, 2, 1, 3, 1]) == []


def test_a_preempted_or_aborted_request_stores_nothing() -> None:
    proposer = SuffixProposer(num_tokens=4)
    ask(proposer, "a", [40, 41, 1, 2, 3, 4], 2)
    proposer.finish("a", None)  # preempted: its outputs so far are not an answer yet
    assert proposer.propose_tokens([9, 1, 2]) == []


def test_the_ring_evicts_old_outputs_and_no_proposal_crosses_a_separator() -> None:
    proposer = SuffixProposer(num_tokens=4, max_spec_factor=8.0, cache_tokens=10)
    finished(proposer, "a", [0], [1, 2, 3, 4, 5])  # | 1 2 3 4 5 -1 . . . . |
    finished(proposer, "b", [0], [6, 7])  # | 1 2 3 4 5 -1 6 7 -1 . |
    assert proposer.propose_tokens([0, 3]) == [4, 5]  # stops at the separator
    # [8, 9, 1] does not fit before the end: the tail is cleared and it starts at 0.
    finished(proposer, "c", [0], [8, 9, 1])  # | 8 9 1 -1 5 -1 6 7 -1 -1 |
    assert proposer.propose_tokens([0, 3]) == []  # a's 3 was overwritten
    assert proposer.propose_tokens([0, 1]) == []  # c's 1 ends c (not a's remnant 5)
    assert proposer.propose_tokens([0, 5]) == []  # a's remnant 5 ends at its separator
    assert proposer.propose_tokens([0, 6]) == [7]  # b ends before the seam (not 8, 9, 1)
    assert proposer.propose_tokens([0, 8]) == [9, 1]


def test_a_wrap_clears_the_tail_of_the_ring() -> None:
    proposer = SuffixProposer(num_tokens=4, max_spec_factor=8.0, cache_tokens=10)
    finished(proposer, "a", [0], [1, 2, 3, 4, 5, 6, 7, 8, 9])  # | 1 2 3 4 5 6 7 8 9 -1 |
    finished(proposer, "b", [0], [5, 6])  # | 5 6 -1 4 5 6 7 8 9 -1 | (wrapped at once)
    finished(proposer, "c", [0], [1, 2, 3])  # | 5 6 -1 1 2 3 -1 8 9 -1 |
    assert proposer.propose_tokens([0, 8]) == [9]  # a's remnant, still whole up to its end
    # [4, 4, 4] does not fit before the end: the remnant in the tail goes with the wrap.
    finished(proposer, "d", [0], [4, 4, 4])  # | 4 4 4 -1 2 3 -1 -1 -1 -1 |
    assert proposer.propose_tokens([0, 8]) == []
    assert proposer.propose_tokens([0, 2]) == [3]  # c's remnant


def test_ties_in_the_ring_go_to_the_newest_output_after_a_wrap() -> None:
    proposer = SuffixProposer(num_tokens=4, cache_tokens=8)
    finished(proposer, "a", [0], [1, 2, 3])  # | 1 2 3 -1 . . . . |
    finished(proposer, "b", [0], [1, 4])  # | 1 2 3 -1 1 4 -1 . |
    finished(proposer, "c", [0], [1, 5])  # | 1 5 -1 -1 1 4 -1 -1 |: c at 0 is newer than b at 4
    assert proposer.propose_tokens([9, 1]) == [5]


def test_an_output_longer_than_the_ring_keeps_its_last_part() -> None:
    proposer = SuffixProposer(num_tokens=4, max_spec_factor=8.0, cache_tokens=4)
    finished(proposer, "a", [0], [1, 2, 3, 4, 5, 6])  # | 4 5 6 -1 |
    assert proposer.propose_tokens([0, 4]) == [5, 6]
    assert proposer.propose_tokens([0, 1]) == []


def test_nothing_is_proposed_without_a_match() -> None:
    proposer = SuffixProposer(num_tokens=4)
    finished(proposer, "a", [0], [5, 6, 7])
    assert proposer.propose_tokens([1, 2, 3, 4]) == []
    assert proposer.propose_tokens([1]) == []
    assert proposer.propose_tokens([]) == []
    assert ask(proposer, "b", [1, 2, 3, 4], 4) == {}  # no entry, not an empty draft


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        SuffixProposer(0)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixProposer(3, max_depth=0)
    for prob in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_token_prob"):
            SuffixProposer(3, min_token_prob=prob)
    with pytest.raises(ValueError, match="max_spec_factor"):
        SuffixProposer(3, max_spec_factor=0.0)
    with pytest.raises(ValueError, match="cache_tokens"):
        SuffixProposer(3, cache_tokens=1)


def test_create_proposer_makes_a_suffix_proposer() -> None:
    proposer = create_proposer("suffix", 3)
    assert isinstance(proposer, SuffixProposer)
    assert proposer.num_tokens == 3
    with pytest.raises(ValueError, match="speculative_method must be ngram or suffix"):
        create_proposer("medusa", 3)
