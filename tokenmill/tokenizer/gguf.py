"""Tokenizers rebuilt from GGUF metadata.

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, scores, token types and merges
as metadata under `tokenizer.ggml.*`. This module reads those keys and builds the equivalent
`tokenizers.Tokenizer`, shaped like the one transformers' GGUF integration builds, so both split
text into the same ids:

- `tokenizer.ggml.model == "llama"`: SentencePiece BPE with byte fallback (`<0xNN>` tokens, `▁` for
  spaces). Merges are recovered from the vocabulary, best score first. Gemma files get Gemma's
  shape: spaces become `▁` in a normalizer (no prefix space), merges follow vocabulary order.
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges and a split regex picked
  by `tokenizer.ggml.pre`.

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added
tokens, so text like "<start_of_turn>" is matched whole instead of being cut into pieces.

Metadata comes from tokenmill/modelfile.py's header reader (not `gguf.GGUFReader`, ~100x slower on
a 262k-token vocabulary).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from tokenmill.modelfile import read_gguf

logger = logging.getLogger(__name__)

# llama.cpp's `llama_token_type` values stored in tokenizer.ggml.token_type.
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes for byte-level vocabularies, keyed by tokenizer.ggml.pre (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
}
# Names that mean GPT-2's own split, which `pre_tokenizers.ByteLevel(use_regex=True)` applies.
_GPT2_SPLIT_NAMES = ("default", "gpt2", "gpt-2")


@dataclass(frozen=True, slots=True)
class GGUFTokenizerSpec:
    """Everything a GGUF file says about its tokenizer.

    Attributes:
        backend: the rebuilt tokenizer, without a post-processor (BOS/EOS are the caller's job).
        architecture: `general.architecture`, e.g. "gemma3", if the file states it.
        add_bos / add_eos: whether plain-text encoding should add BOS / EOS.
        chat_template: `tokenizer.chat_template`, if the file carries one.
    """

    backend: BackendTokenizer
    architecture: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def read_gguf_metadata(
    path: str | Path, prefixes: Iterable[str] = ("general.", "tokenizer.")
) -> dict[str, Any]:
    """The metadata key/values of a GGUF file whose key starts with one of ``prefixes``
    (tokenmill/modelfile.py reads the header; tensor data is not touched)."""
    return read_gguf(path, prefixes).metadata


def load_gguf_tokenizer_spec(path: str | Path) -> GGUFTokenizerSpec:
    """Reads a GGUF file's tokenizer metadata and rebuilds its tokenizer."""
    metadata = read_gguf_metadata(path)
    return build_gguf_tokenizer_spec(metadata)


def build_gguf_tokenizer_spec(metadata: dict[str, Any]) -> GGUFTokenizerSpec:
    """Builds the tokenizer described by GGUF metadata (as `read_gguf_metadata` returns it)."""
    model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    architecture = metadata.get("general.architecture")
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    if model == "llama":
        backend = _build_sentencepiece(
            tokens,
            scores=metadata.get("tokenizer.ggml.scores"),
            file_merges=metadata.get("tokenizer.ggml.merges"),
            is_gemma=str(architecture).startswith("gemma"),
            add_space_prefix=metadata.get("tokenizer.ggml.add_space_prefix", True),
            unk_token_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        )
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        default_add_bos = True
    elif model == "gpt2":
        if "tokenizer.ggml.merges" not in metadata:
            raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
        backend = _build_byte_level(
            tokens, metadata["tokenizer.ggml.merges"], metadata.get("tokenizer.ggml.pre")
        )
        default_add_bos = False
    else:
        raise ValueError(
            f"Unsupported GGUF tokenizer model {model!r}; supported: 'llama' (SentencePiece), "
            "'gpt2' (byte-level BPE)"
        )
    _add_marked_tokens(backend, tokens, token_types, byte_level=model == "gpt2")
    # BOS/EOS/UNK/PAD are special whatever their token type says (transformers does the same).
    special_ids = [
        metadata.get(f"tokenizer.ggml.{name}")
        for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    ]
    backend.add_special_tokens(
        [
            AddedToken(tokens[token_id], normalized=False, special=True)
            for token_id in special_ids
            if token_id is not None
            and 0 <= token_id < len(tokens)
            and backend.token_to_id(tokens[token_id]) is not None  # never grow the vocabulary
        ]
    )
    if len(set(tokens)) != len(tokens):
        logger.warning("GGUF vocabulary repeats token strings; later ids shadow earlier ones")
    return GGUFTokenizerSpec(
        backend=backend,
        architecture=architecture,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        unk_token_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _build_sentencepiece(
    tokens: list[str],
    *,
    scores: Sequence[float] | None,
    file_merges: Sequence[str] | None,
    is_gemma: bool,
    add_space_prefix: bool,
    unk_token_id: int | None,
) -> BackendTokenizer:
    """SentencePiece BPE over the file's pieces, with byte fallback."""
    if is_gemma:
        # Gemma files store the whitespace-run pieces ("  ", "   ", ...) with real spaces, while
        # the text side spells spaces as "▁"; respell them so they can be produced and merged.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        # Gemma's merge order is its vocabulary order; its scores do not all follow it.
        scores = [-float(idx) for idx in range(len(tokens))]
    vocab = {token: idx for idx, token in enumerate(tokens)}
    if file_merges is not None:
        merges = [tuple(merge.split(" ", 1)) for merge in file_merges]
    else:
        if scores is None:
            raise ValueError("GGUF SentencePiece tokenizer has neither merges nor scores")
        merges = _merges_from_scores(tokens, vocab, scores)
    unk_token = tokens[unk_token_id] if unk_token_id is not None else None
    backend = BackendTokenizer(
        BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    decoder_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if is_gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        # NOTE: a no-op after the normalizer, kept because Gemma's own tokenizer.json has it.
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        # "first": the prefix space goes on the text's first piece only, not after each special
        # token (transformers' non-legacy Llama behaviour).
        prepend_scheme = "first" if add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme=prepend_scheme, split=False
        )
        if add_space_prefix:
            decoder_steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decoder_steps)
    return backend


def _merges_from_scores(
    tokens: list[str], vocab: dict[str, int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces.

    Ranked by the merged piece's score (best first), then longer left part, then longer right
    part, then vocabulary order: the order of transformers' `generate_merges`, so ties break alike.
    """
    score_by_token = dict(zip(tokens, scores))  # later duplicates win, as in a dict-built vocab
    ordered_scores = list(score_by_token.values())
    if all(a > b for a, b in zip(ordered_scores, ordered_scores[1:])):
        # Fast path (Gemma, ~1 s for 262k pieces): strictly decreasing scores make the ranking the
        # iteration order, longest left part first, so nothing needs sorting.
        return [
            (piece[:split_idx], piece[split_idx:])
            for piece in score_by_token
            for split_idx in range(len(piece) - 1, 0, -1)
            if piece[:split_idx] in vocab and piece[split_idx:] in vocab
        ]
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for order, (piece, score) in enumerate(score_by_token.items()):
        piece_len = len(piece)
        for split_idx in range(1, piece_len):
            left = piece[:split_idx]
            if left in vocab:
                right = piece[split_idx:]
                if right in vocab:
                    ranked.append((-score, -split_idx, split_idx - piece_len, order, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _build_byte_level(
    tokens: list[str], merges: Sequence[str], pre: str | None
) -> BackendTokenizer:
    """Byte-level BPE over the file's vocabulary and merges."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens are stored byte-level spelled already, except a few added ones written as plain text.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): idx
        for idx, t in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(
        BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_TOKENIZER_SPLITS.get(pre or "default")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if (pre or "default") not in _GPT2_SPLIT_NAMES:
            logger.warning("Unknown tokenizer.ggml.pre %r; splitting text like GPT-2", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_marked_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: Sequence[int], *, byte_level: bool
) -> None:
    """Registers unknown/control tokens as special and user-defined ones as plain added tokens."""
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        # NOTE: in a byte-level vocabulary a "control" token spelled outside the byte alphabet is
        # a converter mislabel; adding it would grow the vocabulary past the model's size.
        if token_type in (_TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_CONTROL)
        and (alphabet is None or set(token) <= alphabet)
    ]
    if special:
        backend.add_special_tokens(special)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_USER_DEFINED and backend.token_to_id(token) is not None
    ]
    if user_defined:
        backend.add_tokens(user_defined)
