"""LLMEngine end to end on the tiny random Llama: batch invariance, seeds, n > 1, stop strings and
stop tokens, abort, and bad input (ValueError naming the field; the engine keeps serving)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_all_blocks_free, random_prompts, run_to_end

from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    # A small token budget, so a batch of 16 prompts is chunked and mixes prefills with decodes.
    # NOTE: one thread: a tiny model gains nothing from more, and on a busy machine OpenMP's
    # spinning threads make these tests several times slower.
    return LLMEngine.from_args(
        model=str(tiny_model_dir("llama")),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=64,
        num_threads=1,
    )


def seeded_params(**changes) -> SamplingParams:
    fields = dict(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True) | changes
    return SamplingParams(**fields)


def test_greedy_output_is_the_same_alone_and_in_a_batch(engine):
    prompts = random_prompts(16, seed=0)
    prompts[5] += list(range(60, 90))  # long enough to leave full blocks in the prefix cache
    (alone,) = run_to_end(engine, [(prompts[5], GREEDY)])
    assert len(alone.outputs[0].token_ids) == 12
    assert engine.reset_prefix_cache()  # the batch computes the prompt again, chunked
    batch = run_to_end(engine, [(p, GREEDY) for p in prompts])
    assert batch[5].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batch[5].outputs[0].text == alone.outputs[0].text
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) > 8  # the prompts do matter
    # And once more on top of the prefix cache.
    (cached,) = run_to_end(engine, [(prompts[5], GREEDY)])
    assert cached.metrics.num_cached_tokens == 16 * ((len(prompts[5]) - 1) // 16)
    assert cached.outputs[0].token_ids == alone.outputs[0].token_ids


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_across_runs(engine):
    prompts = random_prompts(6, seed=1)
    (alone,) = run_to_end(engine, [(prompts[0], SEEDED)])
    tokens = alone.outputs[0].token_ids
    assert len(tokens) == 12
    (again,) = run_to_end(engine, [(prompts[0], SEEDED)])
    assert again.outputs[0].token_ids == tokens
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 3
    others += [seeded_params(seed=7), GREEDY]
    batch = run_to_end(engine, [(prompts[0], SEEDED)] + list(zip(prompts[1:], others)))
    assert batch[0].outputs[0].token_ids == tokens
    # A different seed gives a different sample (the model is not that sure of itself).
    (other_seed,) = run_to_end(engine, [(prompts[0], seeded_params(seed=43))])
    assert other_seed.outputs[0].token_ids != tokens


def test_seeded_sampling_survives_chunking_and_preemption(engine, tiny_model_dir):
    from tokenmill.worker.model_runner import kv_bytes_per_block

    prompts = random_prompts(6, seed=5)
    params = [seeded_params(seed=100 + i, max_tokens=16) for i in range(6)]
    refs = run_to_end(engine, list(zip(prompts, params)))
    config = engine.config.model_config
    # 16 usable blocks of 8 = 128 tokens for 6 requests of up to ~56 tokens: forces preemption.
    tight = LLMEngine.from_args(
        model=str(tiny_model_dir("llama")),
        max_model_len=MAX_MODEL_LEN,
        block_size=8,
        kv_cache_memory=kv_bytes_per_block(config, 8, torch.float32) * 17,
        max_num_batched_tokens=20,
        num_threads=1,
    )
    outs = run_to_end(tight, list(zip(prompts, params)))
    assert tight.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == tight.scheduler.num_preemptions
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_n2_with_seed_gives_two_completions(engine):
    prompt = random_prompts(1, seed=2)[0]
    (out,) = run_to_end(engine, [(prompt, seeded_params(n=2))])
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    # Completion i samples with seed + i, like a request of its own.
    (single,) = run_to_end(engine, [(prompt, seeded_params(seed=43))])
    assert out.outputs[1].token_ids == single.outputs[0].token_ids
    (again,) = run_to_end(engine, [(prompt, seeded_params(n=2))])
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert out.metrics.num_generation_tokens == 24


def find_two_token_stop(engine) -> tuple[str, list[int], str, int]:
    """A prompt whose greedy text has a 2-character string made of two ASCII tokens, first
    occurring after the first token. Returns (prompt, tokens, stop, index of its first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt in ["The quick brown fox", "hello world", "abc", "0123", "Once upon a time"]:
        (out,) = run_to_end(engine, [(prompt, params)])
        tokens = out.outputs[0].token_ids
        pieces = [engine.tokenizer.decode([t]) for t in tokens]
        for k in range(1, len(tokens) - 1):
            a, b = pieces[k], pieces[k + 1]
            if not (len(a) == len(b) == 1 and a.isascii() and b.isascii() and a.isprintable()):
                continue
            prefix = engine.tokenizer.decode(tokens[:k])
            stop = a + b
            if "\ufffd" not in prefix and stop not in prefix + a:
                return prompt, tokens, stop, k
    raise AssertionError("no greedy output with two ASCII tokens in a row")


def test_stop_string_across_tokens_is_cut_from_the_text(engine):
    prompt, tokens, stop, k = find_two_token_stop(engine)
    expected_prefix = engine.tokenizer.decode(tokens[:k])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    (out,) = run_to_end(engine, [(prompt, params)])
    c = out.outputs[0]
    assert c.text == expected_prefix
    assert stop not in c.text
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop
    assert c.token_ids == tokens[: k + 2]  # generation ends on the token completing the string

    keep = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=["never-there", stop],
        include_stop_str_in_output=True,
    )
    (out,) = run_to_end(engine, [(prompt, keep)])
    assert out.outputs[0].text == expected_prefix + stop
    assert out.outputs[0].stop_reason == stop


def test_stop_string_in_streamed_deltas(engine):
    prompt, tokens, stop, k = find_two_token_stop(engine)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    rid = engine.add_request(prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.outputs[0].text_delta)
            if not out.finished:
                assert stop not in out.outputs[0].text
    assert "".join(deltas) == engine.tokenizer.decode(tokens[:k])
    assert_all_blocks_free(engine)


def _outputs_of(engine, params: SamplingParams) -> list:
    """Every RequestOutput of one request with ``params``, step by step."""
    engine.add_request([1, 30, 31, 32], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert_all_blocks_free(engine)
    return outs


def test_output_kinds_carry_the_same_completion(engine):
    """cumulative: everything so far at each step; delta: only what is new, which joins up to
    the same; final_only: one output, the cumulative one at the end. Both sequences of an n=2
    request, with their log-probs."""
    params = seeded_params(n=2, logprobs=1, max_tokens=10)
    cumulative = _outputs_of(engine, params)
    delta = _outputs_of(engine, dataclasses.replace(params, output_kind="delta"))
    (final,) = _outputs_of(engine, dataclasses.replace(params, output_kind="final_only"))
    assert final.finished and len(delta) == len(cumulative) > 2
    for i, want in enumerate(cumulative[-1].outputs):
        got = final.outputs[i]
        assert (got.text, got.token_ids, got.logprobs) == (want.text, want.token_ids, want.logprobs)
        assert got.finish_reason == want.finish_reason == "length"
        parts = [out.outputs[i] for out in delta]
        assert "".join(p.text for p in parts) == want.text
        assert [t for p in parts for t in p.token_ids] == want.token_ids
        assert [lp for p in parts for lp in p.logprobs] == want.logprobs
        assert [p.text for p in parts] == [out.outputs[i].text_delta for out in cumulative]


def test_delta_outputs_added_up_read_as_the_cumulative_ones(engine):
    """What a streaming server keeps (Run.record): the first delta output, ``accumulating``,
    then each later one ``add``-ed, reads at every step as that step's cumulative output, log-
    probs and prompt log-probs included; the outputs added stay as the engine sent them."""
    params = seeded_params(n=2, logprobs=1, prompt_logprobs=1, max_tokens=10)
    cumulative = _outputs_of(engine, params)
    delta = _outputs_of(engine, dataclasses.replace(params, output_kind="delta"))
    sent = [(c.text, list(c.token_ids), list(c.logprobs)) for c in delta[0].outputs]
    total = delta[0].accumulating()
    for step, (part, want) in enumerate(zip(delta, cumulative, strict=True)):
        if step:
            total.add(part)
        assert total.prompt_logprobs == want.prompt_logprobs
        assert total.finished == want.finished
        for got, c in zip(total.outputs, want.outputs, strict=True):
            assert (got.index, got.text, got.token_ids) == (c.index, c.text, c.token_ids)
            assert (got.logprobs, got.finish_reason) == (c.logprobs, c.finish_reason)
            assert (got.text_delta, got.token_ids_delta) == (c.text, c.token_ids)  # one delta
    assert [(c.text, c.token_ids, c.logprobs) for c in delta[0].outputs] == sent
    assert total.metrics.num_generation_tokens == sum(len(c.token_ids) for c in total.outputs)


def test_a_final_only_output_carries_the_gaps_between_its_tokens(engine):
    """No output is built for a final-only request until it ends (the server's non-streaming
    requests), so the engine times the steps that gave it tokens: one gap a token after the
    first (both sequences of n=2), the whole span between its first and last token; the other
    kinds leave them to their readers."""
    params = seeded_params(n=2, max_tokens=8, ignore_eos=True)
    (final,) = _outputs_of(engine, dataclasses.replace(params, output_kind="final_only"))
    gaps = final.metrics.inter_token_latencies
    assert gaps is not None and len(gaps) == 2 * (8 - 1) and all(g >= 0 for g in gaps)
    m = final.metrics
    assert sum(gaps) <= 2 * (m.finished_time - m.first_token_time) + 1e-3
    cumulative = _outputs_of(engine, params)
    assert all(out.metrics.inter_token_latencies is None for out in cumulative)


def test_text_is_the_decoded_tokens_at_max_tokens(engine):
    # The random model emits stray UTF-8 bytes: a tail held back for more bytes must still
    # come out (as U+FFFD) once the request ends.
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt in ["hello world", "The quick brown fox", "abc"]:
        (out,) = run_to_end(engine, [(prompt, params)])
        c = out.outputs[0]
        assert c.text == engine.tokenizer.decode(c.token_ids)


def test_stop_token_ids(engine):
    prompt = random_prompts(1, seed=3)[0]
    (ref,) = run_to_end(engine, [(prompt, GREEDY)])
    tokens = ref.outputs[0].token_ids
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tokens[k]])
    (out,) = run_to_end(engine, [(prompt, params)])
    assert out.outputs[0].token_ids == tokens[: k + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == tokens[k]


def test_max_tokens_gives_finish_reason_length(engine):
    (out,) = run_to_end(
        engine, [("hi", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))]
    )
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].stop_reason is None
    # max_tokens=None fills the context.
    prompt = [1] + [50] * 119
    (out,) = run_to_end(engine, [(prompt, SamplingParams(max_tokens=None, ignore_eos=True))])
    assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - len(prompt)
    assert out.outputs[0].finish_reason == "length"


def test_abort_mid_generation_frees_blocks_and_others_finish(engine):
    prompts = random_prompts(3, seed=4)
    refs = run_to_end(engine, [(p, GREEDY) for p in prompts])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params if i == 1 else GREEDY) for i, p in enumerate(prompts)]
    for _ in range(4):
        engine.step()
    free_before = engine.num_free_blocks
    held = sum(len(t) for t in engine.scheduler.kv.block_ids(ids[1]))
    assert held > 0
    aborted = engine.abort_request(ids[1])
    assert aborted.finished
    assert aborted.outputs[0].finish_reason == "abort"
    assert 0 < len(aborted.outputs[0].token_ids) < 40
    assert engine.num_free_blocks == free_before + held  # back at once, not at the next step
    assert not any(engine.scheduler.kv.block_ids(ids[1]))
    assert engine.abort_request(ids[1]) is None  # already gone
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != ids[1]
            if out.finished:
                done[out.request_id] = out
    for i in (0, 2):
        assert done[ids[i]].outputs[0].token_ids == refs[i].outputs[0].token_ids
        assert done[ids[i]].outputs[0].finish_reason == "length"
    assert_all_blocks_free(engine)


def test_abort_waiting_and_n2_requests(engine):
    rid = engine.add_request("abcdef", seeded_params(n=2))
    engine.step()  # the leader runs; its sibling waits for the leader's prompt
    out = engine.abort_request(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert_all_blocks_free(engine)
    rid = engine.add_request("abcdef", GREEDY)
    out = engine.abort_request(rid)  # never scheduled
    assert out.outputs[0].token_ids == []
    assert_all_blocks_free(engine)
    engine.step()  # the worker forgets it
    assert engine.executor.worker.runner.requests == {}


def test_request_ids(engine):
    rid = engine.add_request("abc", GREEDY, request_id="mine")
    assert rid == "mine"
    with pytest.raises(ValueError, match="request id 'mine'"):
        engine.add_request("abc", GREEDY, request_id="mine")
    run_to_end(engine, [])
    assert_all_blocks_free(engine)


def test_request_id_of_a_sibling_sequence_is_refused_without_harm(engine):
    rid = engine.add_request("abc", seeded_params(n=2), request_id="grp")
    # "grp#1" is the second sequence of "grp"; taking it must not hijack that sequence's output.
    with pytest.raises(ValueError, match="request id 'grp#1' is already in use"):
        engine.add_request("xyz", GREEDY, request_id="grp#1")
    # And the other way round: a new request's second sequence would be an existing request.
    other = engine.add_request("xyz", GREEDY, request_id="solo#1")
    with pytest.raises(ValueError, match="request id 'solo#1' is already in use"):
        engine.add_request("xyz", seeded_params(n=2), request_id="solo")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {rid, other}
    assert [len(c.token_ids) for c in done[rid].outputs] == [12, 12]
    assert engine.output_processor.states == {}
    assert_all_blocks_free(engine)


def _bad_params(**kwargs):
    return lambda: SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda e: e.add_request("", GREEDY), "prompt must not be empty"),
        (lambda e: e.add_request([], GREEDY), "prompt must not be empty"),
        (
            lambda e: e.add_request([1] * 100, SamplingParams(max_tokens=50)),
            r"prompt \(100 tokens\) \+ max_tokens \(50\).*\(128\)",
        ),
        (lambda e: e.add_request([1] * 128, SamplingParams(max_tokens=None)), "128"),
        (lambda e: e.add_request([1, 384], GREEDY), r"prompt token ids .*\[0, 384\).*384"),
        (lambda e: e.add_request([1, -1], GREEDY), r"prompt token ids .*-1"),
        (lambda e: e.add_request([1, 2.5], GREEDY), "prompt token ids"),
        (lambda e: _bad_params(max_tokens=0)(), "max_tokens"),
        (lambda e: _bad_params(max_tokens=-3)(), "max_tokens"),
        (lambda e: _bad_params(temperature=-0.1)(), "temperature"),
        (lambda e: _bad_params(top_p=0.0)(), "top_p"),
        (lambda e: _bad_params(top_p=1.5)(), "top_p"),
        (lambda e: _bad_params(top_k=0)(), "top_k"),
        (lambda e: _bad_params(top_k=-2)(), "top_k"),
        (lambda e: _bad_params(n=0)(), "n must be"),
        (lambda e: _bad_params(min_tokens=5, max_tokens=2)(), "min_tokens"),
        (lambda e: _bad_params(stop=[""])(), "stop"),
        (
            lambda e: e.add_request("abc", SamplingParams(min_tokens=2, stop_token_ids=[384])),
            r"stop_token_ids .*384",
        ),
        (lambda e: e.add_request("abc", SamplingParams(seed=2**64)), "seed"),
    ],
)
def test_bad_input_raises_value_error_and_engine_keeps_serving(engine, make_bad, match):
    with pytest.raises(ValueError, match=match):
        make_bad(engine)
    assert not engine.has_unfinished_requests()
    assert engine.output_processor.states == {}
    (out,) = run_to_end(engine, [("ok", SamplingParams(temperature=0.0, max_tokens=3))])
    assert out.finished and len(out.outputs[0].token_ids) >= 1
    assert_all_blocks_free(engine)


def test_unknown_model_and_non_gguf_file(engine, tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        LLMEngine.from_args(model=str(tmp_path / "no-such-model"))
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLMEngine.from_args(model=str(junk))
    with pytest.raises(ValueError, match="config.json"):
        LLMEngine.from_args(model=str(tmp_path))
    with pytest.raises(ValueError, match="unknown engine arguments: bogus"):
        LLMEngine.from_args(model=str(tmp_path), bogus=1)
    (out,) = run_to_end(engine, [("ok", SamplingParams(temperature=0.0, max_tokens=3))])
    assert out.finished


def test_engine_args_beyond_the_model(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match=r"max_model_len \(1024\).*\(512\)"):
        LLMEngine.from_args(model=path, max_model_len=1024, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMEngine.from_args(model=path, max_model_len=128, kv_cache_memory=1000)
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine.from_args(model=path, max_model_len=512, kv_cache_memory="64KiB")


def test_a_default_context_the_kv_cache_cannot_hold_is_lowered_not_refused(tiny_model_dir, caplog):
    """max_model_len unset (the model's 512) and a KV cache of fewer tokens: the engine starts
    with the context it holds, says so in a warning, and serves a request that long."""
    import logging

    path = str(tiny_model_dir("llama"))
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine.from_args(model=path, kv_cache_memory="64KiB")
    max_len = engine.config.scheduler_config.max_model_len
    assert 0 < max_len < 512
    assert f"max_model_len lowered to {max_len}" in caplog.text
    prompt = [5] * (max_len - 4)
    (out,) = run_to_end(engine, [(prompt, SamplingParams(max_tokens=4, ignore_eos=True))])
    assert len(out.outputs[0].token_ids) == 4
    assert_all_blocks_free(engine)


def test_stats_ask_no_worker_without_router_stats(engine, monkeypatch):
    """The stats are read after every step: only moe_router_stats sends them to the workers
    (a round trip to every tensor-parallel rank)."""
    calls = []
    executor = engine.executor
    monkeypatch.setattr(executor, "collective_rpc", lambda *a, **k: calls.append(a))
    stats = engine.stats()
    assert calls == [] and stats.expert_tokens is None


def test_a_model_without_a_chat_template_is_said_once_and_not_with_one_given(
    tiny_model_dir, tmp_path, caplog
):
    """The tiny llama carries no chat template: its engine warns once that chat uses the
    family's default (loading its tokenizer elsewhere, as a rank does, says nothing); given
    --chat-template, it warns not at all."""
    import logging

    from tokenmill.tokenizer import load_tokenizer

    path = tiny_model_dir("llama")
    warning = "the model carries no chat template"
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine.from_args(model=str(path), max_model_len=128)
        load_tokenizer(path, "llama")
    assert caplog.text.count(warning) == 1
    engine.shutdown()
    caplog.clear()
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine.from_args(
            model=str(path), max_model_len=128, chat_template=str(template)
        )
    assert warning not in caplog.text
    engine.shutdown()
