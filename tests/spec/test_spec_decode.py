"""Speculative decoding with n-gram and suffix proposals through the engine, on tiny random models.

Greedy output must be exactly the output without speculation, for every architecture, in a
batch with chunked prefill and with preemptions forced by a tight KV cache; stop tokens and
max_tokens hold (never more tokens than asked), logprobs come one per token, and every KV
block is free at the end. Prompts repeat a pattern so that proposals exist and some are kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_all_blocks_free

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.kernels import cpu_library
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0)
PROMPTS = [
    [1] + [10, 11, 12, 13, 14] * 6,
    [1, *range(40, 60), *range(40, 60)],
    [1, *range(5, 30)],
]


def generate(path, prompts, params=GREEDY, **kwargs) -> tuple[list, int, LLMEngine]:
    """The finished outputs, how many (request, step) pairs delivered tokens, and the engine."""
    args = dict(model=str(path), max_model_len=256, kv_cache_memory="8MiB")
    if kwargs.get("speculative_method"):  # speculate in batches too (the default stops at 2)
        args["speculative_max_batch"] = 64
    args |= kwargs
    engine = LLMEngine(EngineArgs(**args))
    ids = [engine.add_request(p, params) for p in prompts]
    done, num_deliveries = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_deliveries += 1
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert_all_blocks_free(engine)
    return [done[i] for i in ids], num_deliveries, engine


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_greedy_output_is_the_output_without_it(tiny_model_dir, arch, method) -> None:
    path = tiny_model_dir(arch)
    plain, plain_deliveries, _ = generate(path, PROMPTS)
    spec, spec_deliveries, _ = generate(path, PROMPTS, speculative_method=method)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_deliveries < plain_deliveries  # some steps gave a request kept drafts
    for ours, ref in zip(spec, plain):
        assert len(ours.logprobs) == len(ours.token_ids)
        for got, want in zip(ours.logprobs, ref.logprobs):
            assert got.sampled.token_id == want.sampled.token_id
            assert got.sampled.logprob == pytest.approx(want.sampled.logprob, abs=1e-4)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_with_chunked_prefill_and_preemption(tiny_model_dir, method) -> None:
    path = tiny_model_dir("llama")
    prompts = PROMPTS * 3
    plain, _, _ = generate(path, prompts)
    tight = dict(max_num_batched_tokens=24, kv_cache_memory=28 * 16 * 2 * 2 * 2 * 16 * 4)
    spec, _, engine = generate(path, prompts, speculative_method=method, **tight)
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_ngram_respects_stop_tokens_and_max_tokens(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    (plain,), _, _ = generate(path, PROMPTS[:1])
    stop = plain.token_ids[7]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], logprobs=0),
    ):
        (ref,), _, _ = generate(path, PROMPTS[:1], params)
        (out,), _, _ = generate(
            path, PROMPTS[:1], params, speculative_method="ngram", num_speculative_tokens=8
        )
        assert out.token_ids == ref.token_ids
        assert len(out.logprobs) == len(out.token_ids)
        assert out.finish_reason == ref.finish_reason


def test_no_drafts_for_steps_of_more_requests_than_the_limit(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    plain, plain_deliveries, _ = generate(path, PROMPTS)
    spec, spec_deliveries, _ = generate(
        path, PROMPTS, speculative_method="ngram", speculative_max_batch=len(PROMPTS) - 1
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_deliveries == plain_deliveries  # every step had 3 requests: none speculated
    (alone,), _, _ = generate(path, PROMPTS[:1], speculative_method="ngram")
    _, alone_deliveries, _ = generate(
        path, PROMPTS[:1], speculative_method="ngram", speculative_max_batch=1
    )
    assert alone_deliveries < len(alone.token_ids)  # one request: under the limit


def test_bad_speculative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="speculative_method must be one of ngram"):
        EngineArgs(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_max_batch"):
        EngineArgs(speculative_method="ngram", speculative_max_batch=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineArgs(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=2)


@pytest.mark.skipif(not cpu_library.available(), reason="decode graphs need the C kernels")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_verification_steps_replay_decode_graphs(tiny_model_dir, arch) -> None:
    """Packed weights (int8) run decode steps as graphs; a step with drafts is a graph of one
    row per query, and its tokens are those of plain greedy decoding."""
    path = tiny_model_dir(arch)
    plain, _, _ = generate(path, PROMPTS, quantization="int8")
    spec, _, engine = generate(path, PROMPTS, quantization="int8", speculative_method="ngram")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    graphs = engine.executor.worker.runner.decode_graphs
    assert max(graphs.captured_sizes()) > len(PROMPTS)  # rows of drafts, not just requests


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        dict(speculative_method="ngram"),
        dict(speculative_method="suffix"),
        dict(speculative_method="draft", draft_num_layers=12),  # an early-exit self-draft
    ],
    ids=["ngram", "suffix", "draft"],
)
def test_gemma_output_is_greedy_under_the_target_model(spec) -> None:
    """gemma-3-270m (GGUF, packed, decode graphs) repeating a text it was given: most steps
    keep drafts, and every token is the target model's greedy pick at its position.

    NOTE: not compared token for token with plain decoding: the packed kernels' rounding
    depends on how many rows a matmul has, so plain greedy output already differs between a
    request alone and the same request in a batch of 4 (at token 23 for this prompt, before
    and after the engine seams). Each token must instead be the top token of the model's
    distribution given everything before it (scored by one prefill), or a near-tie: decode
    and prefill round differently, and plain greedy decoding in batches of 2-8 measured
    tokens up to 0.13 nats below the prefill's top (4 of 128), alone on this prompt up to 0.24
    (2 of 127; since Q4_K / Q6_K compute from their super-blocks); a wrong token is nats away.
    """
    text = Path(__file__).read_text()[:1500]
    prompt = f"Here is a file:\n\n{text}\n\nThe same file again, unchanged:\n\n"
    engine = LLMEngine(
        EngineArgs(model="gemma-3-270m", max_model_len=2048, kv_cache_memory="128MiB", **spec)
    )
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=128))
    num_steps, output = 0, []
    while engine.has_unfinished_requests():
        output += [o.outputs[0].token_ids for o in engine.step() if o.finished]
        num_steps += 1
    assert_all_blocks_free(engine)
    (tokens,) = output
    assert len(tokens) == 128 and num_steps < 0.8 * 128  # drafts were kept
    prompt_ids = engine.tokenizer.encode(prompt)
    check = LLMEngine(
        EngineArgs(model="gemma-3-270m", max_model_len=2048, kv_cache_memory="128MiB")
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    check.add_request(prompt_ids + tokens, params)
    while check.has_unfinished_requests():
        for o in check.step():
            scored = o.prompt_logprobs if o.finished else None
    # The first token is the prompt's prefill's own pick, before any draft: scored by a
    # prefill of another length it parts from the top where the float model has a near-tie
    # (this prompt: 0.49 nats between its top two), by up to 0.9 nats as the kernels' rounding
    # falls. What speculation could change starts at the second.
    gaps = [pos.top[0].logprob - pos.sampled.logprob for pos in scored[len(prompt_ids) + 1 :]]
    assert max(gaps) < 0.5 and sum(g > 0 for g in gaps) <= 12, gaps


def test_a_request_can_opt_out(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, speculative=False)
    (plain,), plain_deliveries, _ = generate(path, PROMPTS[:1], params)
    (out,), deliveries, _ = generate(path, PROMPTS[:1], params, speculative_method="ngram")
    assert out.token_ids == plain.token_ids
    assert deliveries == plain_deliveries  # one token a step: no drafts for it


def test_engine_stats_count_drafts_and_kept_tokens(tiny_model_dir) -> None:
    spec_out, _, engine = generate(tiny_model_dir("llama"), PROMPTS, speculative_method="ngram")
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    per_pos = stats.accepted_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a kept draft needs the earlier
    assert 1 < stats.mean_accepted_len <= 1 + 3


def test_rejected_slots_are_never_attended(tiny_model_dir) -> None:
    """After every step, the K/V slots past each request's computed tokens (rejected drafts
    among them) are filled with large values: had any been read, the output would change."""
    path = tiny_model_dir("gemma3")
    plain, _, _ = generate(path, PROMPTS)
    args = EngineArgs(
        model=str(path),
        max_model_len=256,
        kv_cache_memory="8MiB",
        speculative_method="ngram",
        speculative_max_batch=64,
    )
    engine = LLMEngine(args)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    runner = engine.executor.worker.runner
    caches, layer_groups = runner.kv_caches, runner.kv_layout.layer_groups
    block_size = args.block_size
    done, num_poisoned = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for req in engine.scheduler.running:
            tables = engine.scheduler.kv.block_ids(req.req_id)  # a table per group of layers
            for pos in range(req.num_computed_tokens, len(tables[0]) * block_size):
                b, off = divmod(pos, block_size)
                for layer, group in zip(caches, layer_groups):
                    layer[0][tables[group][b], off] = 1e4
                    layer[1][tables[group][b], off] = -1e4
                num_poisoned += 1
    assert num_poisoned > 0
    assert [done[i] for i in ids] == [o.token_ids for o in plain]
    assert_all_blocks_free(engine)


def test_suffix_speculates_from_an_earlier_requests_output(tiny_model_dir) -> None:
    """The same request twice: the second one's drafts come from the first one's output (its
    prompt alone repeats nothing), so nearly every step keeps all of them."""
    path = tiny_model_dir("llama")
    prompt = [1, *range(100, 130)]  # no repeats: nothing for its own context to match
    args = dict(model=str(path), max_model_len=256, kv_cache_memory="8MiB")
    engine = LLMEngine(EngineArgs(speculative_method="suffix", **args))
    deliveries = []
    for _ in range(2):
        engine.add_request(prompt, GREEDY)
        deliveries.append(0)
        while engine.has_unfinished_requests():
            deliveries[-1] += len(engine.step())
    assert_all_blocks_free(engine)
    first, second = deliveries
    assert second < first / 2


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_stop_strings_end_the_output_as_without_speculation(tiny_model_dir, method) -> None:
    """Text, token ids and logprobs are those of decoding one token at a time (a stop string
    inside one step's kept drafts: tests/engine/test_output_processor.py)."""
    path = tiny_model_dir("llama")
    (plain,), _, _ = generate(path, PROMPTS[:1])
    stop = plain.text[12:14]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0, stop=[stop])
    (ref,), _, _ = generate(path, PROMPTS[:1], params)
    (out,), _, _ = generate(path, PROMPTS[:1], params, speculative_method=method)
    assert ref.finish_reason == "stop" and ref.stop_reason == stop
    assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "stop")
    assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_min_tokens_and_n_siblings_as_without_speculation(tiny_model_dir, method) -> None:
    """min_tokens bans the end until it is reached, also on draft rows; n = 2 greedy siblings
    both equal the plain output."""
    path = tiny_model_dir("llama")
    (plain,), _, _ = generate(path, PROMPTS[:1])
    eos = plain.token_ids[5]  # make a token of the plain output the end of the sequence
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, stop_token_ids=[eos])
    extra = dict(draft_num_layers=1) if method == "draft" else {}
    (ref,), _, _ = generate(path, PROMPTS[:1], params)
    (out,), _, _ = generate(path, PROMPTS[:1], params, speculative_method=method, **extra)
    assert len(ref.token_ids) >= 12
    assert out.token_ids == ref.token_ids
    engine = LLMEngine(
        EngineArgs(
            model=str(path),
            max_model_len=256,
            kv_cache_memory="8MiB",
            speculative_method=method,
            **extra,
        )
    )
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, n=2))
    done = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                done = o
    assert [c.token_ids for c in done.outputs] == [plain.token_ids] * 2
    assert_all_blocks_free(engine)
