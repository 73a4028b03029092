"""Routing policy: the prefix key, rendezvous hashing, the overload bound, unhealthy replicas."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenmill.router.policy import (
    BLOCK_CHARS,
    LOAD_SLACK,
    PREFIX_CHARS,
    Reason,
    ReplicaView,
    canonical_messages,
    choose,
    prefix_key,
    rank,
    request_key,
    request_text,
)

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def _views(urls=URLS, healthy=None, loads=None) -> list[ReplicaView]:
    return [
        ReplicaView(u, healthy[i] if healthy else True, loads[i] if loads else 0)
        for i, u in enumerate(urls)
    ]


def _random_keys(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [prefix_key("".join(rng.choices("abcdefgh ", k=300))) for _ in range(n)]


def test_key_is_the_first_whole_blocks() -> None:
    assert (BLOCK_CHARS, PREFIX_CHARS) == (64, 256)
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    assert prefix_key(text) == text[:256]
    assert prefix_key(text[:200]) == text[:192]  # 3 whole blocks
    assert prefix_key(text[:64]) == text[:64]
    assert prefix_key(text[:63]) == text[:63]  # shorter than a block: the whole text
    assert prefix_key("hi", salt="tenant") == "tenant\0hi"


def test_request_text_of_each_shape() -> None:
    assert request_text({"prompt": "abc"}) == "abc"
    assert request_text({"prompt": ["first", "second"]}) == "first"
    assert request_text({"prompt": [1, 2, 3]}) == "1,2,3"
    assert request_text({"prompt": [[4, 5], [6]]}) == "4,5"
    assert request_text({"prompt": "q", "system": "be brief"}) == "be brief\n\nq"  # Ollama
    assert request_text({"model": "m"}) is None
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert canonical_messages(messages) == "system\nS\n\nuser\nab\n\n"
    assert request_text({"messages": messages}) == "system\nS\n\nuser\nab\n\n"


def test_same_prefix_same_replica() -> None:
    system = "You are a helpful assistant. " * 12  # 348 characters: the key is its first 256
    views = _views()
    picks = {
        choose(request_key({"prompt": system + question}), views).replica_idx
        for question in ("What is 2+2?", "Name a colour.", "Why is the sky blue?" * 5)
    }
    assert len(picks) == 1
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    other = [{"role": "system", "content": system}, {"role": "user", "content": "bye"}]
    assert choose(request_key({"messages": chat}), views) == choose(
        request_key({"messages": other}), views
    )
    decision = choose(request_key({"messages": chat}), views)
    assert decision is not None and decision.reason is Reason.PREFIX_HIT


def test_ranking_ignores_replica_order() -> None:
    for key in _random_keys(50):
        order = rank(key, URLS)
        reversed_order = rank(key, URLS[::-1])
        assert [URLS[i] for i in order] == [URLS[::-1][i] for i in reversed_order]


def test_random_prefixes_spread_evenly() -> None:
    counts = Counter(choose(key, _views()).replica_idx for key in _random_keys(4000))
    assert set(counts) == {0, 1, 2, 3}
    # 1000 expected each; binomial sd ~27, so +-15% is over 5 sd.
    assert all(850 <= c <= 1150 for c in counts.values()), counts


def test_removing_a_replica_moves_only_its_keys() -> None:
    keys = _random_keys(2000, seed=1)
    before = {k: URLS[choose(k, _views()).replica_idx] for k in keys}
    fewer = [u for u in URLS if u != URLS[2]]
    after = {k: fewer[choose(k, _views(fewer)).replica_idx] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == URLS[2]}
    assert 400 <= len(moved) <= 600
    # Its keys spread over the others (each key to its second-ranked replica).
    assert len({after[k] for k in moved}) == 3


def test_unhealthy_replica_is_skipped_for_the_next_in_rank() -> None:
    keys = _random_keys(500, seed=2)
    healthy = [True, False, True, True]
    for key in keys:
        decision = choose(key, _views(healthy=healthy))
        assert decision is not None and decision.replica_idx != 1
        first = rank(key, URLS)[0]
        if first == 1:  # the key's next replica, the same one every time: still consistent
            assert decision.replica_idx == rank(key, URLS)[1]
            assert decision.reason is Reason.NEXT_HEALTHY
        else:
            assert decision.replica_idx == first and decision.reason is Reason.PREFIX_HIT
    assert choose(keys[0], _views(healthy=[False] * 4)) is None


def test_overload_falls_back_to_the_least_loaded() -> None:
    key = _random_keys(1)[0]
    first, second, third, fourth = rank(key, URLS)
    loads = [0] * 4
    loads[first] = LOAD_SLACK  # at the bound (2 x 0 + slack): not overloaded
    assert choose(key, _views(loads=loads)).replica_idx == first
    loads[first] = LOAD_SLACK + 1
    decision = choose(key, _views(loads=loads))
    assert decision.reason is Reason.FALLBACK
    assert decision.replica_idx == second  # ties among the least loaded go by the key's rank
    loads = [3] * 4
    loads[first] = 2 * 3 + LOAD_SLACK + 1
    loads[third] = 1
    assert choose(key, _views(loads=loads)).replica_idx == third
    loads[first] = 2 * 1 + LOAD_SLACK  # the bound follows the least-loaded replica
    assert choose(key, _views(loads=loads)).replica_idx == first
    # An unhealthy replica's load does not count.
    loads = [0] * 4
    loads[first] = LOAD_SLACK + 1
    healthy = [True] * 4
    healthy[second] = healthy[third] = healthy[fourth] = False
    assert choose(key, _views(healthy=healthy, loads=loads)).replica_idx == first


def test_no_key_and_exclusions() -> None:
    decision = choose(None, _views(loads=[3, 1, 2, 1]))
    assert decision.replica_idx == 1 and decision.reason is Reason.FALLBACK
    key = _random_keys(1)[0]
    first, second, *_ = rank(key, URLS)
    assert choose(key, _views(), exclude=[first]).replica_idx == second
    assert choose(key, _views(), exclude=range(4)) is None


@pytest.mark.parametrize("salt", ["a", "b"])
def test_salt_is_part_of_the_key(salt: str) -> None:
    assert request_key({"prompt": "x" * 300, "cache_salt": salt}) == f"{salt}\0" + "x" * 256
