"""JSON numbers that end (structured/json_numbers.py): a model that would write digits forever
under a JSON schema stops at a double's 17 significant digits and finishes its JSON; the bound
is off with json_number_digits=0; strings, exponents and rollbacks are followed."""

from __future__ import annotations

import json

import pytest
from conftest import assert_all_blocks_free

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams, StructuredOutputs
from tokenmill.structured.json_numbers import NumberBound

SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "name": {"type": "string", "maxLength": 8}},
    "required": ["x", "name"],
    "additionalProperties": False,
}


def _run(path, json_number_digits: int, digit: str) -> tuple[str, str]:
    engine = LLMEngine(
        EngineArgs(model=str(path), max_model_len=256, kv_cache_memory="8MiB",
                   json_number_digits=json_number_digits)
    )  # fmt: skip
    (digit_id,) = engine.tokenizer.encode(digit, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=120,
        temperature=0,
        logit_bias={digit_id: 30.0},  # a model that would write this digit forever
        structured_outputs=StructuredOutputs(json=SCHEMA),
    )
    engine.add_request([1, 40, 41], params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert_all_blocks_free(engine)
    assert final is not None
    return final.outputs[0].text, final.outputs[0].finish_reason


@pytest.mark.parametrize("digit", ["1", "0"])
def test_a_number_ends_at_a_doubles_digits(tiny_model_dir, digit) -> None:
    text, finish = _run(tiny_model_dir("llama"), 17, digit)
    assert finish == "stop", text
    value = json.loads(text)
    number = json.dumps(value["x"])
    mantissa = number.split("e")[0].replace("-", "").replace(".", "").lstrip("0")
    assert len(mantissa) <= 17


def test_unbounded_numbers_run_to_max_tokens(tiny_model_dir) -> None:
    text, finish = _run(tiny_model_dir("llama"), 0, "1")
    assert finish == "length" and text.count("1") > 100


def test_the_state_follows_strings_exponents_and_rollbacks() -> None:
    texts = ['{"', "a1111", '": ', "12345678", "9", "0", ".", "5", "e", "10", '"', "7"]
    bound = NumberBound.for_vocabulary(texts, 10)
    state = bound.state()
    state.accept([0, 1, 2])  # {"a1111":   (digits in a string are not a number)
    assert state.refused() == []
    state.accept([3, 4])  # 123456789: one more digit of room
    assert {texts[i] for i in state.refused()} == {"12345678", "10"}
    state.accept([5])  # 10 significant digits: no more
    assert {texts[i] for i in state.refused()} == {"12345678", "9", "0", "5", "10", "7"}
    state.accept([6, 7, 8, 9])  # .5e10: the exponent has one digit of room
    assert {texts[i] for i in state.refused()} == {"12345678", "10"}
    state.rollback(4)
    assert {texts[i] for i in state.refused()} == {"12345678", "9", "0", "5", "10", "7"}
