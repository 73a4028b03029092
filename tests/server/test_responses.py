"""server/responses.py without a server: the store's bound, time to live and keys, and how
input items become chat messages."""

from __future__ import annotations

import pytest

from tokenmill.server.errors import APIError
from tokenmill.server.responses import ResponseObject, ResponseStore, _as_messages


def _response(response_id: str) -> ResponseObject:
    return ResponseObject(id=response_id, created_at=0, status="completed", model="m", output=[])


def test_the_store_is_bounded_expires_and_keeps_each_keys_own() -> None:
    now = [0.0]
    store = ResponseStore(size=2, ttl=10.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put("key", [], _response(name))
    with pytest.raises(APIError) as exc:
        store.get("key", "a")  # the oldest went first
    assert exc.value.status == 404
    assert store.get("key", "c").response.id == "c"
    with pytest.raises(APIError):
        store.get("other key", "c")
    now[0] = 10.0
    with pytest.raises(APIError) as exc:
        store.get("key", "c")
    assert "3600" not in exc.value.message and "10 s" in exc.value.message
    keep_none = ResponseStore(size=0, ttl=10.0)
    keep_none.put("key", [], _response("a"))
    with pytest.raises(APIError) as exc:
        keep_none.get("key", "a")
    assert "keeps no responses" in exc.value.message


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "2"}]},
    ]  # fmt: skip
    system, user, calls, out1, out2 = _as_messages(items, "input")
    assert system == {"role": "system", "content": "Be brief."}
    assert user == {"role": "user", "content": "Hi"}
    assert calls["reasoning_content"] == "hm"
    assert [c["id"] for c in calls["tool_calls"]] == ["c1", "c2"]
    assert out1 == {"role": "tool", "tool_call_id": "c1", "content": "1"}
    assert out2["content"] == "2"
