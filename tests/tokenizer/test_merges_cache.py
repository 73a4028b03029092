"""The SentencePiece merges cache (tokenizer/gguf.py ``_cached_merges``): what it returns is
what ``_merges_from_scores`` computes; its entry is keyed by the vocabulary and scores (another
vocabulary or score is another entry); a damaged entry is recomputed; TOKENMILL_NO_CACHE=1 and
small vocabularies skip it."""

from __future__ import annotations

from array import array

import pytest

from tokenmill.tokenizer import gguf

TOKENS = ["a", "b", "c", "ab", "bc", "abc", "ca", "▁", "▁a"]
SCORES = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_NO_CACHE", raising=False)
    monkeypatch.setattr(gguf, "MIN_CACHED_VOCAB", 0)
    return tmp_path / "tokenizers"


def _merges(tokens=TOKENS, scores=SCORES):
    vocab = {t: i for i, t in enumerate(tokens)}
    return gguf._cached_merges(tokens, vocab, scores)


def _computed(tokens=TOKENS, scores=SCORES):
    return gguf._merges_from_scores(tokens, {t: i for i, t in enumerate(tokens)}, scores)


def test_cached_merges_equal_computed_ones(cache, monkeypatch):
    expected = _computed()
    assert expected  # the vocabulary has merges to find
    assert _merges() == expected
    (entry,) = cache.glob("merges-*.bin")
    # A hit reads the entry, it does not compute.
    monkeypatch.setattr(gguf, "_merges_from_scores", lambda *a: pytest.fail("computed"))
    assert _merges() == expected
    assert list(cache.glob("merges-*.bin")) == [entry]


def test_other_scores_or_tokens_are_another_entry(cache):
    _merges()
    scores = list(reversed(SCORES))
    assert _merges(scores=scores) == _computed(scores=scores)
    tokens = [*TOKENS[:-1], "▁b"]
    assert _merges(tokens=tokens) == _computed(tokens=tokens)
    assert len(list(cache.glob("merges-*.bin"))) == 3


def test_damaged_entry_is_recomputed(cache):
    _merges()
    (entry,) = cache.glob("merges-*.bin")
    entry.write_bytes(array("i", [0, 999]).tobytes())  # an id past the vocabulary
    assert _merges() == _computed()
    entry.write_bytes(b"\x01\x02\x03")  # not whole int32s
    assert _merges() == _computed()


def test_no_cache_and_small_vocabularies_skip_it(cache, monkeypatch):
    monkeypatch.setattr(gguf, "MIN_CACHED_VOCAB", len(TOKENS) + 1)
    assert _merges() == _computed() and not cache.exists()
    monkeypatch.setattr(gguf, "MIN_CACHED_VOCAB", 0)
    monkeypatch.setenv("TOKENMILL_NO_CACHE", "1")
    assert _merges() == _computed() and not cache.exists()
