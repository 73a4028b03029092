"""Structured outputs compiled to token-level grammar matchers, with llguidance.

A request's format (SamplingParams.structured_outputs: a JSON schema, JSON object, regex,
choice or grammar) becomes an llguidance grammar, is checked against the model's tokenizer,
and is compiled once into a matcher template; each request copies the template and the worker
advances the copy with every token it keeps (``GrammarMatcher``). Compiling happens where the
request is prepared (a server thread, or the caller of LLMEngine.add_request), never in the
step loop; templates are cached by the format's hash (one compiler per engine, one tokenizer).

A compiled format that leaves its process (to a tensor-parallel rank, or the engine core's own
process) travels as its ``GrammarSource``: llguidance's matcher does not pickle. Where it lands,
the model runner compiles the source again with the model's tokenizer (``compile_source``,
cached there too).

Fail closed: a format llguidance cannot compile or does not support raises ValueError naming
the problem (the server answers 400); a request is never served unconstrained.

No torch here: the engine imports this module. The worker fills token bitmasks
(structured/bitmask.py) from these matchers.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import astuple, dataclass

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured.json_numbers import NumberBound, NumberState
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.gguf import byte_alphabet
from tokenmill.tokenizer.pieces import TokenPieces

# Compiled templates kept per engine (least recently used dropped first).
CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """What compiles a format again in another process: its llguidance grammar and the
    compiler's settings (the model's tokenizer is the one thing it leaves out)."""

    key: str  # the grammar's hash
    grammar: str  # llguidance's grammar (JSON), from to_llguidance_grammar
    bounds_numbers: bool  # a JSON format, whose numbers the compiler's digits bound
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    json_number_digits: int


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled format: ``matcher()`` gives a fresh matcher for one request. It pickles as
    its ``source`` (the matcher cannot leave its process)."""

    source: GrammarSource
    template: object  # llguidance.LLMatcher in its start state (copied, never advanced)
    numbers: NumberBound | None = None  # a JSON format's bound on numbers (json_numbers.py)

    @property
    def key(self) -> str:
        return self.source.key

    def matcher(self) -> GrammarMatcher:
        numbers = self.numbers.state() if self.numbers is not None else None
        template = self.template.deep_copy()  # type: ignore[attr-defined]
        return GrammarMatcher(template, self.source.vocab_size, numbers)

    def __reduce__(self) -> tuple[type[GrammarSource], tuple]:
        return GrammarSource, astuple(self.source)


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, advanced by the
    tokens kept and rolled back over speculative ones."""

    def __init__(
        self, matcher: object, vocab_size: int, numbers: NumberState | None = None
    ) -> None:
        self._m = matcher  # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self._numbers = numbers

    def refused_tokens(self) -> list[int]:
        """Tokens the grammar allows that the number bound refuses next (json_numbers.py)."""
        return self._numbers.refused() if self._numbers is not None else []

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        """Write the allowed next tokens as bits (int32 words, bit i of word w: token 32w + i)
        into ``num_bytes`` of memory at ``address`` (a row of a bitmask tensor)."""
        self._m.unsafe_compute_mask_ptr(address, num_bytes)  # type: ignore[attr-defined]

    def accept(self, token_ids: list[int]) -> int:
        """Advance by as many of ``token_ids`` as the grammar allows, until its output is
        complete; returns how many it recorded (what ``rollback`` may undo).

        NOTE: once the matcher has stopped, llguidance 1.9 accepts an end-of-sequence token
        without recording it, and a rollback counting it would undo the token before (vLLM
        #25905): so nothing is consumed after the stop."""
        if self.is_finished:
            return 0
        num_valid = self._m.validate_tokens(token_ids)  # type: ignore[attr-defined]
        recorded = 0
        for token_id in token_ids[:num_valid]:
            if self.is_finished:
                break
            self._m.consume_token(token_id)  # type: ignore[attr-defined]
            recorded += 1
        if self._numbers is not None:
            self._numbers.accept(token_ids[:recorded])
        return recorded

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)  # type: ignore[attr-defined]
            if self._numbers is not None:
                self._numbers.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        """The grammar's output is complete (only the end of sequence may follow)."""
        return bool(self._m.is_stopped())  # type: ignore[attr-defined]


class GrammarCompiler:
    """Compiles structured-output formats for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        json_number_digits: int = 17,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids  # the ends a complete output may take
        self.json_number_digits = json_number_digits  # 0: numbers unbounded
        self._number_bound: NumberBound | None = None  # built on first JSON format
        self._lock = threading.Lock()
        self._ll_tokenizer: object | None = None  # built on first use (ll_tokenizer)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The format compiled (or its cached template); ValueError naming what is wrong."""
        grammar = to_llguidance_grammar(spec)
        source = GrammarSource(
            key=hashlib.sha256(grammar.encode()).hexdigest(),
            grammar=grammar,
            bounds_numbers=kind(spec) in ("json_schema", "json_object"),
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            json_number_digits=self.json_number_digits,
        )
        return self.compile_source(source, kind(spec))

    def compile_source(self, source: GrammarSource, what: str = "grammar") -> CompiledGrammar:
        """A source compiled here (cached by its key): this compiler's own, or one that came
        from another process with this compiler's settings."""
        import llguidance

        # One engine's formats all come with its settings (the runner builds its compiler from
        # the first one's).
        assert (source.vocab_size, source.eos_token_ids, source.json_number_digits) == (
            self.vocab_size,
            self.eos_token_ids,
            self.json_number_digits,
        ), "a grammar compiled under another engine's settings"
        with self._lock:
            hit = self._cache.get(source.key)
            if hit is not None:
                self._cache.move_to_end(source.key)
                return hit
            ll_tokenizer = self._tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            source.grammar, ll_tokenizer
        )
        if is_error:
            raise ValueError(f"structured output ({what}) is invalid: {messages[0]}")
        template = llguidance.LLMatcher(ll_tokenizer, source.grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured output ({what}) is invalid: {template.get_error()}")
        numbers = None
        if self.json_number_digits and source.bounds_numbers:
            numbers = self._numbers()
        compiled = CompiledGrammar(source, template, numbers)
        with self._lock:
            self._cache[source.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _numbers(self) -> NumberBound:
        with self._lock:
            if self._number_bound is None:
                texts = [
                    self.tokenizer.decode([i], skip_special_tokens=False)
                    for i in range(self.vocab_size)
                ]
                self._number_bound = NumberBound.for_vocabulary(texts, self.json_number_digits)
            return self._number_bound

    def _tokenizer(self) -> object:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._ll_tokenizer


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> object:
    """llguidance's tokenizer for the model's ``vocab_size`` ids (any past the tokenizer's are
    special: no grammar takes them).

    From each token's bytes where the tokenizer has them (its pieces, tokenizer/pieces.py):
    1.4 s at gemma-3's 262k tokens, of which llguidance holds the GIL 1.05 s. Else from the
    tokenizer's JSON, which llguidance parses again: 4.1 s, 2.7 s of it in one call holding
    the GIL. Held by a server thread, the GIL stops the step loop, and every stream with it."""
    import llguidance

    eos = list(eos_token_ids) or None
    pieces = tokenizer.token_pieces
    if pieces is None:
        return llguidance.LLTokenizer(
            plain_added_tokens(tokenizer.backend.to_str()), n_vocab=vocab_size, eos_token=eos
        )
    vocabulary = _Vocabulary(tokenizer, pieces, vocab_size)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=eos
    )


class _Vocabulary:
    """A tokenizer as ``llguidance.TokenizerWrapper`` reads it: each id's bytes, the special
    ids, and a call that encodes text. An added token that is not special (Qwen's <think>) is
    its text, as plain_added_tokens makes it for llguidance's JSON path; ids past the
    tokenizer's are special, named as llguidance names them (``<[id]>``)."""

    def __init__(self, tokenizer: Tokenizer, pieces: TokenPieces, vocab_size: int) -> None:
        known = min(tokenizer.vocab_size, vocab_size)
        beyond = range(known, vocab_size)
        self.tokens = [pieces[i] for i in range(known)] + [f"<[{i}]>".encode() for i in beyond]
        self.special_token_ids = [i for i in tokenizer.special_token_ids if i < known]
        self.special_token_ids += beyond
        self.eos_token_id = tokenizer.eos_token_id  # the compiler passes its own ends
        self.bos_token_id = tokenizer.bos_token_id
        self._encode = tokenizer.backend.encode

    def __call__(self, text: str) -> list[int]:
        # TokenizerWrapper first tries bytes; refused, it passes text from then on.
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._encode(text, add_special_tokens=False).ids


def plain_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer as llguidance should see it: its added tokens that are not special (Qwen's
    <think>, <tool_call>) as ordinary tokens of the vocabulary.

    llguidance takes every added token for a special one, matched only as a marked token and
    never as its text; yet it tokenizes a grammar's forced text with the tokenizer itself, which
    does match them as text. A grammar holding "<think>" then forces that token and refuses it
    at once. A non-special added token is text the model writes: in the vocabulary, llguidance
    lets it stand for its text. (Byte-level BPE vocabularies only, where the token's entry is
    its bytes in the byte-to-unicode alphabet; others are left as they are.)"""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    added = data.get("added_tokens") or []
    if (
        model.get("type") != "BPE"
        or not _is_byte_level(data)
        or all(t.get("special") for t in added)
    ):
        return tokenizer_json
    alphabet = byte_alphabet()
    for token in added:
        if not token.get("special"):
            text = "".join(alphabet[b] for b in token["content"].encode("utf-8"))
            model["vocab"][text] = token["id"]
    data["added_tokens"] = [t for t in added if t.get("special")]
    return json.dumps(data)


def _is_byte_level(data: dict) -> bool:
    def has(node: object) -> bool:
        if not isinstance(node, dict):
            return False
        return node.get("type") == "ByteLevel" or any(has(n) for n in node.get("pretokenizers", []))

    return has(data.get("pre_tokenizer")) or has(data.get("decoder"))


def kind(spec: StructuredOutputs) -> str:
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(spec, name) is not None:
            return "json_schema" if name == "json" else name
    return "json_object"


def to_llguidance_grammar(spec: StructuredOutputs) -> str:
    """The format as an llguidance grammar (its JSON form); ValueError if it cannot be one."""
    import llguidance

    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured output (json_schema) is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured output (json_schema) must be a JSON object")
        # Fail closed on keywords llguidance would otherwise skip (lenient off); separators as
        # json.dumps writes them, the way models write JSON; no free whitespace, which a
        # sampling model could otherwise fill without end.
        options = {
            "whitespace_flexible": False,
            "lenient": False,
            "item_separator": ", ",
            "key_separator": ": ",
        }
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.regex is not None:
        try:
            re.compile(spec.regex)
        except re.error as e:
            raise ValueError(f"structured output (regex) is not a valid regex: {e}") from None
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("|".join(map(re.escape, spec.choice)))
    assert spec.grammar is not None
    lark = spec.grammar
    if "::=" in lark:  # GBNF (llama.cpp's grammars): llguidance converts it to its Lark dialect
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(lark)
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions
            raise ValueError(f"structured output (grammar) is not valid GBNF: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)
