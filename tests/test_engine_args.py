"""EngineArgs: a value of the wrong type is a ValueError that names the field and what it takes."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineArgs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": "4096"}, "max_model_len must be an integer; got '4096'"),
        ({"max_num_seqs": 2.0}, "max_num_seqs must be an integer; got 2.0"),
        ({"seed": True}, "seed must be an integer; got True"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number"),
        ({"enforce_eager": "no"}, "enforce_eager must be True or False; got 'no'"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_numbers_of_the_right_kind_pass() -> None:
    args = EngineArgs(max_model_len=None, gpu_memory_utilization=1, num_threads=None, seed=3)
    assert args.gpu_memory_utilization == 1 and args.max_model_len is None
