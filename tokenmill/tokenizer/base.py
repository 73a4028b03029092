"""The tokenizer the engine uses, and loading one from a GGUF file or a Hugging Face directory.

`Tokenizer` wraps a `tokenizers.Tokenizer` (Rust, fast) and owns what the backend does not: which
ids are BOS/EOS/stop tokens, whether plain encoding adds BOS, and the chat template.

NOTE: BOS/EOS are added here from `add_bos`/`add_eos`, never by the backend's post-processor
(which is removed), so a tokenizer.json whose post-processor adds BOS cannot add it twice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.tokenizer.chat import ChatTemplate, default_chat_template, end_of_turn_tokens
from tokenmill.tokenizer.gguf import load_gguf_tokenizer_spec
from tokenmill.tokenizer.pieces import TokenPieces, token_pieces


class Tokenizer:
    """Text <-> token ids, special token ids, and chat rendering for one model.

    Args:
        backend: the `tokenizers.Tokenizer`; its post-processor is removed (see module note).
        architecture: the model family ("gemma3", "llama", "mistral", "qwen2", "qwen3"); picks the
            default chat template and end-of-turn tokens.
        bos_token_id / eos_token_id / pad_token_id: special ids, None when the model has none.
        add_bos / add_eos: whether `encode(add_special_tokens=True)` adds BOS / EOS.
        chat_template: the model's Jinja chat template; None means the family default.
        extra_stop_token_ids: more ids that end generation (e.g. generation_config's eos list).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        architecture: str,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> None:
        backend.post_processor = None
        self._backend = backend
        self.architecture = architecture
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.add_eos = add_eos and eos_token_id is not None
        self.bos_token: str | None = self._token_text(bos_token_id)
        self.eos_token: str | None = self._token_text(eos_token_id)
        # Ids that `decode(skip_special_tokens=True)` drops.
        self.special_token_ids: frozenset[int] = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )

        # The model carries none: a family's default stands in (chat_template_warning).
        self.chat_template_is_default = chat_template is None
        if chat_template is None:
            chat_template = default_chat_template(
                architecture, lambda text: backend.token_to_id(text) is not None
            )
        self.chat_template: str | None = chat_template

        stop_ids = [eos_token_id] if eos_token_id is not None else []
        for text in end_of_turn_tokens(architecture):
            token_id = backend.token_to_id(text)
            if token_id is not None:
                stop_ids.append(token_id)
        stop_ids.extend(extra_stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stop_ids))

    def chat_template_warning(self) -> str | None:
        """What whoever serves chat should warn of this tokenizer's chat template, or None: the
        model carries none, so a family's default stands in, or none at all. Said where chat
        is served (LLMEngine), not at every load (ranks, a draft's check, benchmarks)."""
        if not self.chat_template_is_default:
            return None
        if self.chat_template is None:
            return f"No chat template in the model and none known for {self.architecture!r}"
        # Often a base model, which continues a chat instead of ending its reply.
        return (
            "the model carries no chat template (a base model?): chat uses the "
            f"{self.architecture} default, and replies may not end; cap them with max_tokens"
        )

    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text (e.g. "<start_of_turn>") maps to its id.

        With `add_special_tokens`, BOS / EOS are added as `add_bos` / `add_eos` say.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                ids.append(self.eos_token_id)
        return ids

    @cached_property
    def token_pieces(self) -> TokenPieces | None:
        """Each token's bytes in decoded text, where decoding is their concatenation (pieces.py;
        the incremental detokenizer's table), else None."""
        return token_pieces(self._backend)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; ids outside the vocabulary are ignored."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of `token_ids` (e.g. "▁Hello", "<0xE4>").

        Raises:
            ValueError: for an id outside the vocabulary.
        """
        tokens = []
        for token_id in token_ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            tokens.append(token)
        return tokens

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Renders a conversation to prompt text.

        Messages are {"role": ..., "content": ...} with role system/user/assistant and content a
        string or a list of OpenAI text parts. Extra keyword arguments become template variables.

        Raises:
            ValueError: for a bad role or content, or when there is no chat template.
        """
        return self._compiled_chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation, with exactly one BOS where the model wants one.

        Templates that write BOS text themselves (Gemma, Llama) are encoded without adding
        another; the others get BOS as plain `encode` would add it.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        has_bos_text = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_special_tokens=not has_bos_text)

    @cached_property
    def _compiled_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise ValueError(
                f"The model has no chat template and {self.architecture!r} has no default"
            )
        return ChatTemplate(
            self.chat_template, bos_token=self.bos_token or "", eos_token=self.eos_token or ""
        )

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(architecture={self.architecture!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token!r}, eos={self.eos_token!r}, add_bos={self.add_bos})"
        )


def load_tokenizer(path: str | Path, architecture: str) -> Tokenizer:
    """Loads the tokenizer of a `.gguf` file or a Hugging Face model directory.

    Args:
        path: a `.gguf` file, or a directory with tokenizer.json (+ tokenizer_config.json,
            special_tokens_map.json, generation_config.json, chat_template.jinja, all optional).
        architecture: the model family ("gemma3", "llama", "mistral", "qwen2", "qwen3").

    Raises:
        ValueError: when no tokenizer can be found at `path`.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, architecture)
    if path.is_dir():
        return _load_hf_directory(path, architecture)
    raise ValueError(
        f"No tokenizer at {path}: expected a .gguf file or a directory with tokenizer.json"
    )


def _load_gguf(path: Path, architecture: str) -> Tokenizer:
    spec = load_gguf_tokenizer_spec(path)
    return Tokenizer(
        spec.backend,
        architecture=architecture,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
        add_bos=spec.add_bos,
        add_eos=spec.add_eos,
        chat_template=spec.chat_template,
    )


def _load_hf_directory(directory: Path, architecture: str) -> Tokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        hint = (
            " (tokenizer.model alone is not supported; convert it to tokenizer.json)"
            if (directory / "tokenizer.model").exists()
            else ""
        )
        raise ValueError(f"No tokenizer files in {directory}: tokenizer.json is missing{hint}")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    generation = _read_json(directory / "generation_config.json")

    def special_id(name: str) -> int | None:
        text = _token_content(config.get(name, special_map.get(name)))
        return None if text is None else backend.token_to_id(text)

    generation_eos = generation.get("eos_token_id")
    generation_eos_ids = (
        [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    )
    bos_id = special_id("bos_token")
    if bos_id is None:
        bos_id = generation.get("bos_token_id")
    eos_id = special_id("eos_token")
    if eos_id is None and generation_eos_ids:
        eos_id = generation_eos_ids[0]
    pad_id = special_id("pad_token")
    if pad_id is None:
        pad_id = generation.get("pad_token_id")

    probed_bos, probed_eos = _post_processor_adds(backend, bos_id, eos_id)
    return Tokenizer(
        backend,
        architecture=architecture,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        add_bos=bool(config.get("add_bos_token", probed_bos)),
        add_eos=bool(config.get("add_eos_token", probed_eos)),
        chat_template=_hf_chat_template(directory, config),
        extra_stop_token_ids=generation_eos_ids,
    )


def _post_processor_adds(
    backend: BackendTokenizer, bos_id: int | None, eos_id: int | None
) -> tuple[bool, bool]:
    """Whether the tokenizer.json post-processor adds BOS / EOS (used when the config is silent)."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    if len(full) == len(plain):
        return False, False
    return bool(full) and full[0] == bos_id, bool(full) and full[-1] == eos_id


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's template, else chat_template.json's."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template


def _token_content(token: Any) -> str | None:
    """A special token from a config: a string, or an AddedToken dict with "content"."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)
