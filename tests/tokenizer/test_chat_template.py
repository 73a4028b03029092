"""Chat templates: family defaults render the official formats; message checks; Jinja setup."""

from __future__ import annotations

import json

import pytest

from tokenmill.tokenizer.chat import (
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    LLAMA2_TEMPLATE,
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    ChatTemplate,
    chat_family,
    default_chat_template,
    end_of_turn_tokens,
    normalize_messages,
)

CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "How are you?"},
]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *CONVERSATION]

# (template, bos, eos, rendered CONVERSATION with a generation prompt,
#  rendered WITH_SYSTEM without one)
DEFAULT_CASES = {
    "gemma": (
        GEMMA_TEMPLATE,
        "<bos>",
        "<eos>",
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n"
        "<start_of_turn>model\n",
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n",
    ),
    "llama3": (
        LLAMA3_TEMPLATE,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>",
    ),
    "llama2": (
        LLAMA2_TEMPLATE,
        "<s>",
        "</s>",
        "<s>[INST] Hi there [/INST] Hello! </s><s>[INST] How are you? [/INST]",
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello! </s>"
        "<s>[INST] How are you? [/INST]",
    ),
    "mistral": (
        MISTRAL_TEMPLATE,
        "<s>",
        "</s>",
        "<s>[INST] Hi there [/INST] Hello!</s>[INST] How are you? [/INST]",
        "<s>[INST] Be brief.\n\nHi there [/INST] Hello!</s>[INST] How are you? [/INST]",
    ),
    "chatml": (
        CHATML_TEMPLATE,
        "",
        "<|im_end|>",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n",
    ),
}


@pytest.mark.parametrize("name", sorted(DEFAULT_CASES))
def test_default_templates_render_exactly(name: str) -> None:
    source, bos, eos, expected, expected_with_system = DEFAULT_CASES[name]
    template = ChatTemplate(source, bos_token=bos, eos_token=eos)
    assert template.render(CONVERSATION) == expected
    assert template.render(WITH_SYSTEM, add_generation_prompt=False) == expected_with_system


@pytest.mark.parametrize("source", [GEMMA_TEMPLATE, LLAMA2_TEMPLATE, MISTRAL_TEMPLATE])
def test_alternation_violation_is_a_value_error(source: str) -> None:
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ValueError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize(
    ("architecture", "has_header_token", "expected"),
    [
        ("gemma3", False, GEMMA_TEMPLATE),
        ("llama", True, LLAMA3_TEMPLATE),
        ("llama", False, LLAMA2_TEMPLATE),
        ("mistral", False, MISTRAL_TEMPLATE),
        ("qwen2", False, CHATML_TEMPLATE),
        ("qwen3", False, CHATML_TEMPLATE),
        ("gpt_neox", False, None),
    ],
)
def test_default_template_per_family(
    architecture: str, has_header_token: bool, expected: str | None
) -> None:
    def has_token(text: str) -> bool:
        return has_header_token and text == "<|start_header_id|>"

    assert default_chat_template(architecture, has_token) == expected


def test_end_of_turn_tokens_per_family() -> None:
    assert end_of_turn_tokens("gemma3") == ("<end_of_turn>",)
    assert end_of_turn_tokens("llama") == ("<|eot_id|>", "<|eom_id|>")
    assert end_of_turn_tokens("qwen2") == end_of_turn_tokens("qwen3") == ("<|im_end|>",)
    assert end_of_turn_tokens("mistral") == ()
    assert chat_family("Qwen3") == "chatml"
    assert chat_family("phi3") is None


def test_content_parts_are_joined_and_other_keys_kept() -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
            "name": "bob",
        },
        {"role": "assistant", "content": None},
    ]
    assert normalize_messages(messages) == [
        {"role": "user", "content": "first\nsecond", "name": "bob"},
        {"role": "assistant", "content": ""},
    ]
    template = ChatTemplate(CHATML_TEMPLATE)
    assert template.render(messages[:1], add_generation_prompt=False) == (
        "<|im_start|>user\nfirst\nsecond<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "robot", "content": "x"}], "allowed roles are system, user, assistant, tool"),
        ([{"role": "developer", "content": "x"}], "'developer'"),
        ([{"content": "x"}], "'role'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": 5}], "string or a list"),
    ],
)
def test_bad_messages_raise_value_error(messages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_messages(messages)
    with pytest.raises(ValueError, match=match):
        ChatTemplate(CHATML_TEMPLATE).render(messages)


def test_jinja_environment_matches_transformers_conventions() -> None:
    # trim_blocks/lstrip_blocks drop block lines; loop controls, tojson (non-ASCII kept),
    # strftime_now and {% generation %} are available as in transformers.
    source = (
        "{% for m in messages %}\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}\n"
        "{% endfor %}\n"
        "{{ strftime_now('%Y') | length }}|{{ tools | tojson }}"
    )
    rendered = ChatTemplate(source).render(
        [{"role": "user", "content": "Grüße <b>"}, {"role": "user", "content": "never"}],
        tools=[{"name": "é"}],
    )
    assert rendered == '"Grüße <b>"4|' + json.dumps([{"name": "é"}], ensure_ascii=False)


def test_template_that_does_not_compile_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
