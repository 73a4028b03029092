"""Request bodies to SamplingParams (server/protocol.py): tokenmill's own extensions."""

from __future__ import annotations

from tokenmill.server.config import ServerConfig
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest


def test_speculative_false_opts_a_request_out_of_speculation() -> None:
    limits = ServerConfig(served_model_name="m")
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    assert CompletionRequest(**body).to_sampling_params(limits, 64).speculative
    off = CompletionRequest(**body, speculative=False).to_sampling_params(limits, 64)
    assert off.speculative is False
    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], speculative=False
    )
    assert chat.to_sampling_params(limits, 64).speculative is False
