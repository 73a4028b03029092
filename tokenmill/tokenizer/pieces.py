"""Token pieces: the bytes each token adds to decoded text, where decoding is their concatenation.

Under the two decoders GGUF tokenizers get (gguf.py), as Hugging Face's Llama 3, Qwen and Gemma
files have them, a token's text does not depend on its neighbours:
- ``ByteLevel`` (GPT-2's BPE): each character of the token stands for one byte;
- SentencePiece's ``Replace("▁", " "), ByteFallback, Fuse`` (Gemma, Llama 2, Mistral): "▁" is
  a space, ``<0xAB>`` the byte AB, any other token its UTF-8; some add ``Strip(" ", 1, 0)``,
  which drops the text's first space.
So the text of ids is their bytes joined, decoded as UTF-8, as llama.cpp does it
(``token_to_piece``). The incremental detokenizer (engine/detokenizer.py) reads this table for
each output token, a list lookup where a tokenizers call decodes a window (~1.4 us a token).
Where a run of bytes is invalid, UTF-8 decoding and these decoders may differ (ByteFallback puts
one U+FFFD a byte): the detokenizer leaves such text to the tokenizer's own decode.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.tokenizer.gguf import byte_alphabet

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_STEPS = [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_STRIP_FIRST_SPACE = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


class TokenPieces:
    """Token id -> its bytes in decoded text, filled in as ids are first read.

    Args:
        backend: the tokenizer whose tokens these are.
        byte_level: a ``ByteLevel`` decoder; else SentencePiece's steps (module doc).
        strips_first_space: the decoder drops the decoded text's first space.
    """

    def __init__(self, backend: BackendTokenizer, byte_level: bool, strips_first_space: bool):
        self._backend = backend
        self._byte_level = byte_level
        self.strips_first_space = strips_first_space
        self._table: list[bytes | None] = [None] * backend.get_vocab_size(with_added_tokens=True)
        self._byte_of = {ch: b for b, ch in byte_alphabet().items()} if byte_level else {}

    def __getitem__(self, token_id: int) -> bytes:
        """The bytes of ``token_id``, an id within the vocabulary."""
        piece = self._table[token_id]
        if piece is None:
            piece = self._table[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id)
        if token is None:  # a hole in the ids (none in the vocabularies we load)
            return b""
        if self._byte_level:
            # As the decoder does: a token with a character outside the byte alphabet (an
            # added token's text) stands for its own UTF-8.
            byte_of = self._byte_of
            if all(ch in byte_of for ch in token):
                return bytes(byte_of[ch] for ch in token)
            return token.encode()
        byte = byte_token_value(token)
        if byte is not None:
            return bytes([byte])
        return token.replace("▁", " ").encode()


def byte_token_value(token: str) -> int | None:
    """The byte a SentencePiece byte-fallback token (``<0xAB>``) stands for; None for others."""
    match = _BYTE_TOKEN.fullmatch(token)
    return None if match is None else int(match.group(1), 16)


def token_pieces(backend: BackendTokenizer) -> TokenPieces | None:
    """The token pieces of ``backend``, or None where its decoder is not one of the module's
    (decoding is then more than joining bytes: the tokenizer decodes)."""
    decoder = backend.decoder
    if decoder is None:
        return None  # tokens are joined with spaces
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    if spec.get("type") == "ByteLevel":
        return TokenPieces(backend, byte_level=True, strips_first_space=False)
    steps = spec.get("decoders") if spec.get("type") == "Sequence" else None
    if steps == _SENTENCEPIECE_STEPS:
        return TokenPieces(backend, byte_level=False, strips_first_space=False)
    if steps == [*_SENTENCEPIECE_STEPS, _STRIP_FIRST_SPACE]:
        return TokenPieces(backend, byte_level=False, strips_first_space=True)
    return None
