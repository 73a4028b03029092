"""Constrained generation through the engine on tiny random models sampled at temperature 1:
every output follows its format (jsonschema validates JSON, regexes fully match, a choice is
one of the choices, grammar outputs parse), with and without speculation, and every KV block
is free at the end."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import assert_all_blocks_free

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "c"]},
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,6}-[0-9]{2,4}"
CHOICES = ["positive", "negative", "neutral"]
# A Lark grammar of small sums: "1+22+3".
GRAMMAR = 'start: num ("+" num)*\nnum: /[0-9]{1,3}/'


def run(engine: LLMEngine, spec: StructuredOutputs, num: int, max_tokens: int = 120):
    outs = {}
    for i in range(num):
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=spec
        )
        outs[engine.add_request([1, 5 + i % 50, 7], params)] = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    assert_all_blocks_free(engine)
    return list(outs.values())


@pytest.fixture(scope="module", params=[None, "ngram"])
def engine(request, tiny_model_dir):
    return LLMEngine(
        EngineArgs(
            model=str(tiny_model_dir("llama")),
            max_model_len=256,
            kv_cache_memory="16MiB",
            max_num_seqs=32,
            speculative_method=request.param,
            speculative_max_batch=32,
        )
    )


def test_json_schema_outputs_validate(engine) -> None:
    outs = run(engine, StructuredOutputs(json=SCHEMA), 100, max_tokens=200)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_outputs_parse(engine) -> None:
    for out in run(engine, StructuredOutputs(json_object=True), 20, max_tokens=60):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # cut by max_tokens before the object closed
            assert out.finish_reason == "length"


def test_regex_choice_and_grammar_outputs_match(engine) -> None:
    for out in run(engine, StructuredOutputs(regex=REGEX), 100):
        assert re.fullmatch(REGEX, out.text), out.text
    for out in run(engine, StructuredOutputs(choice=CHOICES), 100):
        assert out.text in CHOICES
    for out in run(engine, StructuredOutputs(grammar=GRAMMAR), 50):
        if out.finish_reason == "stop":
            assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", out.text), out.text


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strnig"}}}),
            "strnig",
        ),
        (StructuredOutputs(json='{"type": '), "not JSON"),
        (StructuredOutputs(regex="a(b"), "not a valid regex"),
        (StructuredOutputs(grammar="start: foo"), "unknown name"),
        (StructuredOutputs(json={"type": "string", "format": "no-such-format"}), "format"),
    ],
)
def test_bad_formats_are_refused(engine, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests()


def test_exactly_one_format_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


def test_formats_survive_preemption(tiny_model_dir) -> None:
    """A KV cache too small for the batch preempts requests; a resumed request's matcher is
    rebuilt from its outputs so far, and every output still validates."""
    block = 16 * 2 * 2 * 2 * 16 * 4  # a block of the tiny Llama's K and V, float32
    engine = LLMEngine(
        EngineArgs(
            model=str(tiny_model_dir("llama")),
            max_model_len=256,
            kv_cache_memory=24 * block,
            max_num_batched_tokens=32,
        )
    )
    outs = run(engine, StructuredOutputs(json=SCHEMA), 12, max_tokens=200)
    assert engine.stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
