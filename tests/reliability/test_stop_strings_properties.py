"""Stop strings across token boundaries (hypothesis), through the real OutputProcessor and the
tiny models' byte-level tokenizer, where every byte is a token: a stop string, and each
multi-byte character in it, is split across tokens however the draw falls.

Oracle, from one token at a time: let T_k be the text the detokenizer has made final after k
output tokens (the last one flushed, as a finish flushes). The first k whose T_k contains a stop
string ends the output, cut at the earliest such occurrence (kept with
include_stop_str_in_output); with none, the output is all the text and finishes by length. The
processor must agree whether tokens come one per step or several at once (kept speculative
drafts), and what it streams (the deltas) must add up to the final text: nothing it sent is
ever taken back.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenmill.core.sched_output import RequestUpdate
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.request import FinishReason, Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer, load_tokenizer
from tokenmill.tokenizer.byte_level import write_byte_tokenizer

ALPHABET = "ab é東🧌"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(path, 384)
    return load_tokenizer(path, "llama")


def oracle(
    tok: Tokenizer, prompt: list[int], output: list[int], params: SamplingParams
) -> tuple[str, str, int]:
    """(text, finish reason, number of tokens kept) from one token at a time."""
    detok = IncrementalDetokenizer(tok, prompt)
    text = ""
    for k, token_id in enumerate(output, 1):
        text += detok.update([token_id])
        if k == len(output):
            text += detok.flush()
        hits = [(text.find(s), s) for s in params.stop if s in text]
        if hits:
            idx, stop = min(hits)
            end = idx + len(stop) if params.include_stop_str_in_output else idx
            return text[:end], "stop", k
    return text, "length", len(output)


def run(
    tok: Tokenizer, prompt: list[int], output: list[int], params: SamplingParams, sizes: list[int]
) -> tuple[str, str, int, str]:
    """Feed ``output`` in steps of ``sizes`` tokens; (text, finish, tokens, concatenated deltas)."""
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [Request("r", prompt, params)], params)
    deltas, idx, step, out = [], 0, 0, None
    while idx < len(output):
        ids = output[idx : idx + sizes[step % len(sizes)]]
        idx, step = idx + len(ids), step + 1
        last = idx >= len(output)
        processor.process(
            [RequestUpdate("r", ids, finish_reason=FinishReason.LENGTH if last else None)]
        )
        (out,) = processor.collect()
        deltas.append(out.outputs[0].text_delta)
        if out.finished:
            break
    assert out is not None and out.finished
    completion = out.outputs[0]
    return completion.text, completion.finish_reason, len(completion.token_ids), "".join(deltas)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=14),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3),
)
def test_stop_strings_match_the_one_token_oracle(
    tok: Tokenizer, text: str, stops: list[str], include: bool, sizes: list[int]
) -> None:
    prompt = tok.encode("Q:")
    output = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=64)
    want_text, want_finish, want_tokens = oracle(tok, prompt, output, params)
    event(want_finish)
    one = run(tok, prompt, output, params, [1])
    many = run(tok, prompt, output, params, sizes)
    for got_text, got_finish, got_tokens, streamed in (one, many):
        assert (got_text, got_finish, got_tokens) == (want_text, want_finish, want_tokens)
        assert streamed == got_text
    if not include:
        assert not any(s in want_text for s in stops)


def test_a_stop_string_split_inside_a_character(tok: Tokenizer) -> None:
    """ "東" is three byte tokens; the stop "東b" completes two tokens after its first byte."""
    prompt = tok.encode("Q:")
    output = tok.encode("a東b東c", add_special_tokens=False)
    params = SamplingParams(stop=["東b"], max_tokens=64)
    assert run(tok, prompt, output, params, [1])[:3] == ("a", "stop", 5)
    assert run(tok, prompt, output, params, [4])[:3] == ("a", "stop", 5)
