"""Incremental detokenization: output token ids to text, one final piece at a time.

Each token goes through a stream: where decoding is a concatenation of the tokens' bytes
(tokenizer/pieces.py: byte-level BPE and SentencePiece's byte fallback), ``_ByteStream`` adds
the token's bytes from a table and emits them once they are whole UTF-8 (a list lookup); else
tokenizers' ``DecodeStream`` (one Rust call: it decodes a short window with and without the new
token and returns the difference). Both return nothing while the text ends in an incomplete
character. Where a stream's text holds invalid bytes (U+FFFD: it may split a run that a
whole decode renders as one), would wait forever (a run of bytes that can never become a
character), or the output ends, the same scheme runs here in Python (vLLM's
prefix_offset/read_offset) on the same window, which also cuts such a run in bounded pieces:

    | ... emitted ... | prefix (context) | pending (decoded, not yet emitted) |
                      ^ prefix_offset    ^ read_offset                        ^ len(ids)

Decoding with context is what gets SentencePiece spaces right: "▁world" decodes to "world" alone
under a decoder that strips the first space, but to " world" after "Hello".

Rule: the concatenation of everything `update()` and `flush()` return equals
`decode(prompt + output)[len(decode(prompt)):]`, provided
- decode(prompt) is a prefix of decode(prompt + output), i.e. the prompt does not end inside a
  UTF-8 character, and
- no run of byte-fallback tokens in the output turns invalid after a complete character in it
  was emitted (tokenizers renders a whole invalid run as U+FFFD; emitted text is final).
Without `flush()`, only a held-back incomplete UTF-8 tail (at most 3 tokens) is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from tokenmill.tokenizer.pieces import TokenPieces, byte_token_value

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token. One decodable token is enough
# for the decoders we build (a byte run is extended separately); a few more, as in vLLM, guard
# decoders that look further back, at no real cost.
_NUM_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes: more pending bytes than that never become valid.
_MAX_PENDING_BYTES = 4
# Drop decoded ids from the window's head past this many, so memory stays bounded.
_COMPACT_AT = 1024


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, never emitting a partial character.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt; its last few tokens are decode context for the output.
        skip_special_tokens: drop special tokens (BOS, <end_of_turn>, ...) from the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # NOTE: skipped special tokens never enter the decode window. Decoding drops them before
        # the decoder runs, so the text is the same, and the window keeps real text as context.
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._vocab_size = tokenizer.vocab_size
        self._pieces = tokenizer.token_pieces
        self._ids = self._context_ids(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), lazily
        # All output token ids so far (special ones included); read, do not mutate. An attribute,
        # not a property: the output processor reads it for every stream every step.
        self.token_ids: list[int] = []
        self._num_decoded = 0  # output ids decoded so far; the rest were deferred (``defer``)
        self._next_piece = self._new_stream()

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Appends output tokens; returns the text that became final with them (may be "")."""
        self.token_ids.extend(new_token_ids)
        return self._step(self._take_deferred(new_token_ids))

    def defer(self, new_token_ids: Sequence[int]) -> None:
        """Appends output tokens whose text no one reads yet (a response sent whole): they are
        decoded by the next call that returns text, at once by ``finish``."""
        self.token_ids.extend(new_token_ids)

    def finish(self, new_token_ids: Sequence[int] = ()) -> str:
        """``update`` then ``flush``: the rest of the text, as the output ends. Deferred tokens
        are decoded in one call where that gives what token by token would (``_decode_rest``),
        else token by token."""
        self.token_ids.extend(new_token_ids)
        ids = self._take_deferred(new_token_ids)
        text = self._decode_rest(ids) if len(ids) > 1 else None
        if text is None:
            text = self._step(ids) + self._emit(force=True)
            self._next_piece = self._new_stream()
        return text

    def flush(self) -> str:
        """Emits text still held back (an incomplete UTF-8 tail, as U+FFFD); call at the end."""
        return self.finish()

    def _take_deferred(self, new_token_ids: Sequence[int]) -> Sequence[int]:
        """The ids to decode now: the deferred ones, then ``new_token_ids`` (both already in
        the output ids)."""
        start, self._num_decoded = self._num_decoded, len(self.token_ids)
        if start == self._num_decoded - len(new_token_ids):
            return new_token_ids  # nothing was deferred
        return self.token_ids[start:]

    def _decode_rest(self, token_ids: Sequence[int]) -> str | None:
        """The text of the window's pending ids and ``token_ids`` through the end, from one
        decode of the whole window; None where token by token could differ.

        By the module's rule, the pieces token by token (then a flush) concatenate to
        decode(window + ids) minus decode(its context) when that context's text is a prefix
        and no byte run in the rest is invalid; with no U+FFFD in the rest, none is.
        """
        kept = [t for t in token_ids if t not in self._skipped_ids and 0 <= t < self._vocab_size]
        head = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :] + kept)
        if not full.startswith(head) or "\ufffd" in full[len(head) :]:
            return None
        self._ids.extend(kept)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None
        self._compact()
        self._next_piece = self._new_stream()
        return full[len(head) :]

    def _step(self, new_token_ids: Sequence[int]) -> str:
        """The token-by-token path: each token through the stream, or the window here."""
        pieces = []
        next_piece = self._next_piece
        for token_id in new_token_ids:
            # NOTE: ids past the tokenizer's vocabulary (a model's padded embedding rows) decode
            # to nothing; in the window they would count as pending bytes.
            if token_id in self._skipped_ids or not 0 <= token_id < self._vocab_size:
                continue
            self._ids.append(token_id)
            try:
                piece = next_piece(token_id)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
                # Its window's text changed under it (invalid bytes now decode otherwise,
                # "Invalid prefix encountered"): the Python window decides, as below.
                piece = "\ufffd"
            if piece is not None and "\ufffd" not in piece:  # the window moves as the stream's
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                self._prefix_text = None
                if self._prefix_offset > _COMPACT_AT:
                    self._compact()
                pieces.append(piece)
            elif piece is not None or len(self._ids) - self._read_offset >= _MAX_PENDING_BYTES:
                # Invalid bytes (the stream may split a run full decoding renders as one U+FFFD),
                # or more pending than one character holds: the window here decides what goes
                # out, and a new stream goes on from it.
                pieces.append(self._emit(force=False))
                next_piece = self._next_piece = self._new_stream()
        return pieces[0] if len(pieces) == 1 else "".join(pieces)

    def _new_stream(self) -> Callable[[int], str | None]:
        """A stream's step (token id -> its text, or None while pending) whose context is the
        window's prefix, fed its pending ids."""
        prefix = self._ids[self._prefix_offset : self._read_offset]
        pending = self._ids[self._read_offset :]
        if self._pieces is not None:
            return _ByteStream(self._pieces, prefix, pending).step
        stream = DecodeStream(ids=prefix, skip_special_tokens=self._skip_special_tokens)
        backend = self._tokenizer.backend
        for token_id in pending:
            stream.step(backend, token_id)  # None: they are still pending
        return partial(stream.step, backend)

    def _emit(self, force: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        num_pending = len(self._ids) - self._read_offset
        end = len(self._ids)
        if text.endswith("\ufffd") and not force:
            if num_pending < _MAX_PENDING_BYTES:
                return ""  # the tail is a split UTF-8 character: wait for its remaining bytes
            # Too many pending bytes to be one character, but invalid bytes before a character
            # that is still arriving (b7 c5 | e4 9c, then 87) must not cut it: emit up to the
            # last point the text can be split at unchanged, and keep waiting for the rest.
            end = self._last_clean_cut(text)
            if end < len(self._ids):
                text = self._decode(self._ids[self._prefix_offset : end])
        if len(text) <= len(self._prefix_text) and not force:
            return ""  # e.g. a token with no text; keep it in the window
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = None
        self._compact()
        return new_text

    def _compact(self) -> None:
        if self._prefix_offset > _COMPACT_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _last_clean_cut(self, text: str) -> int:
        """The largest index ``cut`` past the read offset at which decoding the window's head
        and tail apart gives ``text`` (the whole window's decode): no character, complete or
        still arriving, spans it. ``len(ids)`` when there is none."""
        for cut in range(len(self._ids) - 1, self._read_offset, -1):
            head = self._decode(self._ids[self._prefix_offset : cut])
            if head + self._decode(self._ids[cut:]) == text:
                return cut
        return len(self._ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _context_ids(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last few decodable tokens, not starting inside a run of byte tokens (a
        window that cut a multi-byte character would decode its bytes as U+FFFD)."""
        context: list[int] = []
        idx = len(prompt_token_ids)
        while idx > 0 and len(context) < _NUM_CONTEXT_TOKENS:
            idx -= 1
            if prompt_token_ids[idx] not in self._skipped_ids:
                context.append(prompt_token_ids[idx])
        while context and idx > 0 and self._is_byte_token(context[-1]):
            idx -= 1
            if prompt_token_ids[idx] not in self._skipped_ids:
                context.append(prompt_token_ids[idx])
        context.reverse()
        return context

    def _is_byte_token(self, token_id: int) -> bool:
        try:
            (token,) = self._tokenizer.convert_ids_to_tokens([token_id])
        except ValueError:
            return False
        return byte_token_value(token) is not None


class _ByteStream:
    """DecodeStream's steps from a table of token bytes (where decoding is their concatenation):
    a token's text once the bytes since the last text are whole UTF-8, None while they are not
    or add nothing. Invalid bytes come out as U+FFFD, which sends the detokenizer to its window
    (the tokenizer's decoder renders them its own way).

    Args:
        pieces: the tokenizer's token bytes.
        prefix: the window's context ids (decoded before; a stripping decoder strips the first
            space of the text when they add none).
        pending: ids after them not yet emitted.
    """

    __slots__ = ("_pieces", "_pending", "_strip")

    def __init__(self, pieces: TokenPieces, prefix: Sequence[int], pending: Sequence[int]):
        self._pieces = pieces
        self._strip = pieces.strips_first_space and not any(pieces[t] for t in prefix)
        self._pending = b"".join(pieces[t] for t in pending)

    def step(self, token_id: int) -> str | None:
        data = self._pending + self._pieces[token_id] if self._pending else self._pieces[token_id]
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = data.decode(errors="replace")
            if text.endswith("\ufffd"):  # an incomplete character, or invalid bytes: wait
                self._pending = data
                return None
        if self._strip and text.startswith(" "):
            text = text[1:]
        if not text:
            self._pending = data
            return None
        self._pending = b""
        self._strip = False
        return text
