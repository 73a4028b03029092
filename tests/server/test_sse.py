"""server/sse.py: a chunk event from the run's frame reads as the pydantic chunk model dumped
whole, whichever way its choice is serialized."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionChunk,
)
from tokenmill.server.sse import ChunkFrame


def _whole(chunk_cls, choice, include_usage: bool) -> str:
    chunk = chunk_cls(id="cmpl-1", created=1_700_000_000, model="m", choices=[choice])
    exclude = {"timings"} if include_usage else {"timings", "usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


@given(text=st.text(), index=st.integers(0, 7), include_usage=st.booleans(),
       stop=st.one_of(st.none(), st.integers(0, 10**6), st.text(max_size=5)))  # fmt: skip
def test_plain_and_model_events_are_the_whole_chunk(text, index, include_usage, stop) -> None:
    chat = ChunkFrame(ChatCompletionChunk, ChatChunkChoice, "cmpl-1", 1_700_000_000, "m",
                      include_usage)  # fmt: skip
    choice = ChatChunkChoice(index=index, delta={"content": text})
    want = _whole(ChatCompletionChunk, choice, include_usage)
    assert chat.event(choice) == want
    assert json.loads(chat.plain_event(index=index, delta={"content": text})[6:]) == json.loads(
        want[6:]
    )
    completion = ChunkFrame(CompletionChunk, CompletionChoice, "cmpl-1", 1_700_000_000, "m",
                            include_usage)  # fmt: skip
    choice = CompletionChoice(index=index, text=text, finish_reason="stop", stop_reason=stop)
    want = _whole(CompletionChunk, choice, include_usage)
    got = completion.plain_event(index=index, text=text, finish_reason="stop", stop_reason=stop)
    assert got.startswith("data: {") and got.endswith("}\n\n")
    assert json.loads(got[6:]) == json.loads(want[6:])


def test_a_field_the_choice_lacks_is_refused() -> None:
    frame = ChunkFrame(CompletionChunk, CompletionChoice, "cmpl-1", 0, "m", False)
    with pytest.raises(ValueError, match=r"CompletionChoice has no fields \['txt'\]"):
        frame.plain_event(index=0, txt="x")
