"""Benchmark datasets: lengths, seeds, shared prefixes, ShareGPT and JSONL files."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.datasets import DatasetSpec, dataset_spec_from, sample_requests
from tokenmill.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir("llama"), "llama")


def test_random_token_prompts_have_exact_lengths_and_follow_the_seed(tokenizer):
    spec = DatasetSpec(num_prompts=50, input_len=40, output_len=10, range_ratio=0.5, seed=4)
    ds = sample_requests(spec, tokenizer, token_ids=True)
    assert ds.length_unit == "tokens"
    lens = [r.prompt_len for r in ds.requests]
    assert all(len(r.prompt) == r.prompt_len for r in ds.requests)
    assert min(lens) >= 20 and max(lens) <= 60 and len(set(lens)) > 10
    assert all(5 <= r.output_len <= 15 for r in ds.requests)
    assert sample_requests(spec, tokenizer, token_ids=True) == ds
    other = DatasetSpec(num_prompts=50, input_len=40, output_len=10, range_ratio=0.5, seed=5)
    assert sample_requests(other, tokenizer, token_ids=True) != ds
    # Nothing from the special tokens (ids 0-2 of the tiny tokenizer).
    assert min(min(r.prompt) for r in ds.requests) >= 3


def test_random_text_prompts_reencode_to_their_length(tokenizer):
    ds = sample_requests(DatasetSpec(num_prompts=10, input_len=32, seed=1), tokenizer)
    for r in ds.requests:
        assert isinstance(r.prompt, str)
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert r.prompt_len <= 32 and r.output_len == 128


def test_random_words_without_a_tokenizer():
    ds = sample_requests(DatasetSpec(num_prompts=3, input_len=12, output_len=4, seed=0))
    assert ds.length_unit == "words"
    assert [len(r.prompt.split()) for r in ds.requests] == [12, 12, 12]
    assert [r.prompt_len for r in ds.requests] == [12, 12, 12]


def test_shared_prefix_prompts_start_alike_and_end_apart(tokenizer):
    spec = DatasetSpec("shared-prefix", num_prompts=4, input_len=8, prefix_len=64, seed=2)
    ids = sample_requests(spec, tokenizer, token_ids=True).requests
    assert len({tuple(r.prompt[:64]) for r in ids}) == 1
    assert len({tuple(r.prompt[64:]) for r in ids}) == 4
    assert [r.prompt_len for r in ids] == [72] * 4
    words = sample_requests(spec).requests
    assert len({" ".join(r.prompt.split()[:64]) for r in words}) == 1
    assert [r.prompt_len for r in words] == [72] * 4


def _sharegpt(tmp_path, rows) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    return str(path)


def test_sharegpt_first_human_turn_and_the_reply_length(tmp_path):
    rows = [
        {"conversations": [{"from": "system", "value": "be brief"},
                           {"from": "human", "value": "what is the capital of France"},
                           {"from": "gpt", "value": "the capital of France is Paris"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "gpt", "value": "orphan reply"}]},
        {"id": "no conversations"},
    ]  # fmt: skip
    path = _sharegpt(tmp_path, rows)
    ds = sample_requests(DatasetSpec("sharegpt", path, num_prompts=2))
    # "hi" (1 word, under vLLM's minimum of 4) is filtered out; the one left repeats.
    assert [r.prompt for r in ds.requests] == ["what is the capital of France"] * 2
    assert [(r.prompt_len, r.output_len) for r in ds.requests] == [(6, 6), (6, 6)]
    fixed = sample_requests(DatasetSpec("sharegpt", path, num_prompts=2, output_len=9, seed=0))
    # A fixed output length skips the filter: both pairs, in the seed's order.
    assert sorted(r.prompt for r in fixed.requests) == ["hi", "what is the capital of France"]
    assert {r.output_len for r in fixed.requests} == {9}


def test_jsonl_prompts_and_their_output_lengths(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two", "output_len": 3}\n\n{"prompt": "three"}\n')
    ds = sample_requests(DatasetSpec("jsonl", str(path), num_prompts=3))
    assert [(r.prompt, r.prompt_len, r.output_len) for r in ds.requests] == [
        ("one two", 2, 3),
        ("three", 1, 128),
        ("one two", 2, 3),
    ]
    ds = sample_requests(DatasetSpec("jsonl", str(path), num_prompts=2, output_len=7))
    assert [r.output_len for r in ds.requests] == [7, 7]


def test_bad_specs_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="needs a FILE"):
        dataset_spec_from(["sharegpt"])
    with pytest.raises(ValueError, match="takes no FILE"):
        dataset_spec_from(["random", "x.json"])
    with pytest.raises(ValueError, match="must be one of"):
        dataset_spec_from(["alpaca"])
    with pytest.raises(ValueError, match="range-ratio"):
        DatasetSpec(range_ratio=1.0)
    with pytest.raises(ValueError, match="cannot read dataset"):
        sample_requests(DatasetSpec("jsonl", str(tmp_path / "missing.jsonl")))
