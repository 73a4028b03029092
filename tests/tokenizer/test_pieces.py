"""Token pieces (tokenizer/pieces.py): each token's bytes, for the decoders under which decoding
is their concatenation, checked against the tokenizer's own decode on the embedded models'
whole vocabularies; other decoders get none (the detokenizer then decodes with tokenizers)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from tokenmill.embedded import DEFAULT_MODEL, GEMMA_3_270M
from tokenmill.models.loader import load_model_config
from tokenmill.resolve import resolve_model
from tokenmill.tokenizer import Tokenizer, load_tokenizer
from tokenmill.tokenizer.pieces import token_pieces


def _embedded(name: str) -> Tokenizer:
    config = load_model_config(resolve_model(name))
    assert config.source is not None
    return load_tokenizer(config.source.path, config.architecture)


@pytest.fixture(scope="module", params=[GEMMA_3_270M, DEFAULT_MODEL])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return _embedded(request.param)


def test_every_token_decodes_to_its_piece(tok: Tokenizer) -> None:
    """Gemma's SentencePiece (262k ids, byte fallback) and SmolLM2's byte-level BPE (49k)."""
    pieces = tok.token_pieces
    assert pieces is not None and not pieces.strips_first_space
    for token_id in range(tok.vocab_size):
        piece = pieces[token_id].decode(errors="replace")
        # A lone byte piece decodes to U+FFFD either way, one byte at a time.
        assert piece == tok.decode([token_id], skip_special_tokens=False), token_id


def test_random_ids_decode_to_their_joined_pieces(tok: Tokenizer) -> None:
    """Where the joined bytes are valid UTF-8, they are the text of the ids."""
    pieces = tok.token_pieces
    assert pieces is not None
    rng = random.Random(0)
    specials = tok.special_token_ids
    checked = 0
    for _ in range(3000):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids += tok.encode(rng.choice(["é", " 東京", "🧌", " ok"]), add_special_tokens=False)
        ids = [t for t in ids if t not in specials]
        try:
            text = b"".join(pieces[t] for t in ids).decode()
        except UnicodeDecodeError:
            continue  # invalid bytes: the detokenizer leaves them to the decoder
        assert text == tok.decode(ids), ids
        checked += 1
    assert checked > 1000


def test_byte_level_alphabet_is_gpt2s() -> None:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = BackendTokenizer(BPE(vocab, []))
    backend.decoder = decoders.ByteLevel()
    pieces = token_pieces(backend)
    assert pieces is not None
    for ch, token_id in vocab.items():
        (byte,) = pieces[token_id]
        assert backend.decode([token_id]) == bytes([byte]).decode(errors="replace"), ch


def _sentencepiece(decoder: decoders.Decoder | None) -> BackendTokenizer:
    backend = BackendTokenizer(BPE({"<unk>": 0, "▁a": 1, "<0x41>": 2}, [], unk_token="<unk>"))
    backend.decoder = decoder
    return backend


def test_a_stripping_decoder_says_so() -> None:
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    plain = token_pieces(_sentencepiece(decoders.Sequence(steps)))
    strip = token_pieces(_sentencepiece(decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])))
    assert plain is not None and not plain.strips_first_space
    assert strip is not None and strip.strips_first_space
    assert [plain[1], plain[2]] == [b" a", b"A"]


@pytest.mark.parametrize(
    "decoder",
    [
        None,  # tokens joined with spaces
        decoders.Metaspace(),
        decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()]),
        decoders.WordPiece(),
    ],
)
def test_other_decoders_have_no_pieces(decoder: decoders.Decoder | None) -> None:
    assert token_pieces(_sentencepiece(decoder)) is None
