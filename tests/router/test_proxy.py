"""What the proxy holds back before committing a response: SSE preambles and early errors."""

from __future__ import annotations

import json

from tokenmill.router.proxy import first_output_event, is_preamble, retryable_error


def _event(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


ROLE = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None}]})  # fmt: skip
TOKEN = _event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
TEXT = _event({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]})
FINISH = _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
ABORTED = _event({"error": {"message": "shutting down", "type": "service_unavailable",
                            "param": None, "code": "aborted"}})  # fmt: skip
BAD = _event({"error": {"message": "bad", "code": "invalid_value"}})


def test_only_chat_role_chunks_are_preambles() -> None:
    assert is_preamble(ROLE.strip())
    for event in (TOKEN, TEXT, FINISH, ABORTED, b"data: [DONE]", b": comment"):
        assert not is_preamble(event.strip()), event


def test_first_output_event_waits_for_a_whole_event_past_the_preamble() -> None:
    assert first_output_event(ROLE) is None
    assert first_output_event(ROLE + TOKEN[:20]) is None  # incomplete
    assert first_output_event(ROLE + TOKEN) == TOKEN.strip()
    assert first_output_event((ROLE + ROLE + TEXT).replace(b"\n", b"\r\n")) == TEXT.strip()
    assert first_output_event(b"data: [DONE]\n\n") == b"data: [DONE]"


def test_which_early_errors_retry() -> None:
    assert retryable_error(ABORTED.strip()) == "aborted"
    assert retryable_error(BAD.strip()) is None  # the same request fails anywhere
    assert retryable_error(TOKEN.strip()) is None
    assert retryable_error(b"data: [DONE]") is None
