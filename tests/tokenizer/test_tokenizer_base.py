"""Tokenizer from a Hugging Face directory: special ids, BOS handling, stop ids, chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from tokenmill.tokenizer import Tokenizer, load_tokenizer

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Grüße aus München. 你好，世界。",
] * 10
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def backend_json() -> str:
    backend = BackendTokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend.to_str()


def write_model_dir(
    directory: Path,
    backend_json: str,
    config: dict[str, Any] | None,
    *,
    bos_post_processor: bool = False,
    files: dict[str, Any] | None = None,
) -> Path:
    """A tokenizer.json (optionally with a BOS-adding post-processor) plus config files."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = BackendTokenizer.from_str(backend_json)
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
        )
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        text = content if isinstance(content, str) else json.dumps(content)
        (directory / name).write_text(text)
    return directory


@pytest.fixture
def model_dir(tmp_path: Path, backend_json: str) -> Path:
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False, "special": True},
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": TEMPLATE,
    }
    files = {"generation_config.json": {"eos_token_id": [1, 4]}}
    return write_model_dir(tmp_path / "model", backend_json, config, files=files)


def test_special_ids_and_flags(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir, "qwen2")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.add_bos
    assert tok.vocab_size == 320
    # eos, then qwen's <|im_end|> (id 4), which generation_config also lists: no duplicates.
    assert tok.stop_token_ids == (1, 4)
    assert tok.special_token_ids == frozenset(range(5))


def test_encode_adds_bos_once_and_decode_round_trips(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir, "qwen2")
    text = "Hello world!\n  Grüße 你好 <|im_start|>x"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[1:] == tok.encode(text, add_special_tokens=False)
    assert 3 in ids  # "<|im_start|>" is matched whole
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert tok.decode(ids) == text.replace("<|im_start|>", "")
    tokens = tok.convert_ids_to_tokens(tok.encode("Hello world!"))
    assert tokens[0] == "<s>" and "".join(tokens[1:]) == "HelloĠworld!"  # byte-level spelling
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([10_000])


def test_post_processor_bos_is_detected_and_not_doubled(tmp_path: Path, backend_json: str) -> None:
    directory = write_model_dir(
        tmp_path / "m", backend_json, {"bos_token": "<s>"}, bos_post_processor=True
    )
    tok = load_tokenizer(directory, "llama")
    assert tok.add_bos
    ids = tok.encode("Hello")
    assert ids[0] == 0 and ids.count(0) == 1
    # An explicit config flag wins over the post-processor.
    directory = write_model_dir(
        tmp_path / "n",
        backend_json,
        {"bos_token": "<s>", "add_bos_token": False},
        bos_post_processor=True,
    )
    assert load_tokenizer(directory, "llama").encode("Hello")[0] != 0


def test_special_tokens_map_and_generation_config_fallbacks(
    tmp_path: Path, backend_json: str
) -> None:
    directory = write_model_dir(
        tmp_path / "m",
        backend_json,
        config=None,
        files={
            "special_tokens_map.json": {"bos_token": {"content": "<s>"}, "pad_token": "<pad>"},
            "generation_config.json": {"eos_token_id": 4},
        },
    )
    tok = load_tokenizer(directory, "mistral")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 4, 2)
    assert not tok.add_bos
    assert tok.stop_token_ids == (4,)


def test_chat_template_from_config_and_encode_chat(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir, "qwen2")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tok.apply_chat_template(messages)
    assert text == "<s>[system] Be brief.\n[user] Hi\n[assistant] "
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi\n")
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1


def test_chat_template_jinja_file_wins(tmp_path: Path, backend_json: str) -> None:
    directory = write_model_dir(
        tmp_path / "m",
        backend_json,
        {"bos_token": "<s>", "chat_template": "config"},
        files={"chat_template.jinja": "{{ messages[0]['content'] }}!"},
    )
    tok = load_tokenizer(directory, "qwen2")
    assert tok.apply_chat_template([{"role": "user", "content": "jinja"}]) == "jinja!"
    # No BOS text at the start: encode_chat adds BOS as plain encoding would (add_bos is off).
    assert tok.encode_chat([{"role": "user", "content": "Hi"}]) == tok.encode("Hi!")


def test_named_chat_templates_pick_default(tmp_path: Path, backend_json: str) -> None:
    templates = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "plain"},
    ]
    directory = write_model_dir(tmp_path / "m", backend_json, {"chat_template": templates})
    assert load_tokenizer(directory, "qwen2").apply_chat_template([]) == "plain"


def test_family_default_template_when_model_has_none(tmp_path: Path, backend_json: str) -> None:
    directory = write_model_dir(tmp_path / "m", backend_json, {"eos_token": "<|im_end|>"})
    tok = load_tokenizer(directory, "qwen3")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.stop_token_ids == (4,)


def test_bad_role_names_allowed_roles(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir, "qwen2")
    with pytest.raises(ValueError, match="allowed roles are system, user, assistant, tool"):
        tok.apply_chat_template([{"role": "robot", "content": "{}"}])


def test_no_template_and_unknown_family(tmp_path: Path, backend_json: str) -> None:
    directory = write_model_dir(tmp_path / "m", backend_json, {})
    tok = load_tokenizer(directory, "gpt_neox")
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        load_tokenizer(empty, "llama")
    (empty / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="tokenizer.model alone is not supported"):
        load_tokenizer(empty, "llama")
    with pytest.raises(ValueError, match="No tokenizer at"):
        load_tokenizer(tmp_path / "missing.gguf", "llama")


def test_tokenizer_from_backend_without_bos(backend_json: str) -> None:
    tok = Tokenizer(
        BackendTokenizer.from_str(backend_json), architecture="llama", add_bos=True, add_eos=True
    )
    # add_bos / add_eos cannot hold without the ids.
    assert not tok.add_bos and not tok.add_eos
    assert tok.stop_token_ids == ()
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)
