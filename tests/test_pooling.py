"""Embeddings (pooling.py): what a checkpoint declares, and the engine's vectors against
transformers' on the tiny random Qwen3 (its final hidden states pooled last / mean / cls,
normalized or not), with prompts in one batch, split over prefill chunks and repeated (the
prefix cache)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompts, run_to_end

from tokenmill.engine import LLMEngine
from tokenmill.pooling import Pooling, checkpoint_pooling, serving_pooling
from tokenmill.sampling_params import SamplingParams


def _reference(model_dir, prompts: list[list[int]], pooling: Pooling) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling.method]
            out.append(
                torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector
            )
    return out


@pytest.mark.parametrize(
    "method, normalize", [("last", True), ("mean", True), ("cls", False), ("mean", False)]
)
def test_the_engine_pools_as_transformers_does(embedding_model_dir, method, normalize) -> None:
    model_dir = embedding_model_dir(method, normalize)
    pooling = checkpoint_pooling(model_dir)
    assert pooling == Pooling(method, normalize)
    # Chunks of 16 tokens split the longer prompts; the prefix cache sees repeats.
    engine = LLMEngine.from_args(
        model=str(model_dir), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
        block_size=8, num_threads=1,
    )  # fmt: skip
    assert engine.info.pooling == pooling
    prompts = random_prompts(5, seed=3)
    prompts += [prompts[0], prompts[1][:9]]
    params = SamplingParams(pooling=pooling)
    outs = run_to_end(engine, [(p, params) for p in prompts])
    for out, want in zip(outs, _reference(model_dir, prompts, pooling)):
        assert out.finished and out.outputs[0].token_ids == []
        assert out.outputs[0].finish_reason == "stop"
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-4, rtol=1e-4)


def test_a_generative_model_embeds_with_task_embed(tiny_model_dir) -> None:
    engine = LLMEngine.from_args(
        model=str(tiny_model_dir("llama")), dtype="float32", task="embed", num_threads=1
    )
    assert engine.info.pooling == Pooling("last", True)
    (out,) = run_to_end(engine, [([1, 5, 6, 7], SamplingParams(pooling=engine.info.pooling))])
    assert len(out.embedding) == 64
    assert torch.tensor(out.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)


def test_what_a_checkpoint_declares(tiny_model_dir, embedding_model_dir, tmp_path) -> None:
    assert checkpoint_pooling(tiny_model_dir("llama")) is None
    assert serving_pooling("auto", tiny_model_dir("llama")) is None
    assert serving_pooling("generate", embedding_model_dir("last")) is None
    assert serving_pooling("auto", embedding_model_dir("last")) == Pooling("last", True)
    bad = tmp_path / "bad"
    (bad / "1_Pooling").mkdir(parents=True)
    (bad / "modules.json").write_text(json.dumps(
        [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))  # fmt: skip
    (bad / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        checkpoint_pooling(bad)
    with pytest.raises(ValueError, match="task must be one of"):
        serving_pooling("classify", None)


@pytest.mark.parametrize("kind, want", [(1, Pooling("mean")), (3, Pooling("last")), (0, None)])
def test_a_ggufs_pooling_type(tmp_path, kind, want) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_pooling_type(gguf.PoolingType(kind))
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert checkpoint_pooling(path) == want


def test_llm_embed(embedding_model_dir, tiny_model_dir) -> None:
    from tokenmill.entrypoints.llm import LLM

    model_dir = embedding_model_dir("mean")
    llm = LLM(str(model_dir), dtype="float32", num_threads=1)
    prompts = random_prompts(2, seed=5)
    vectors = llm.embed(prompts, use_tqdm=False)
    for got, want in zip(vectors, _reference(model_dir, prompts, Pooling("mean"))):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4)
    text_model = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1)
    with pytest.raises(ValueError, match='task="embed"'):
        text_model.embed("hi")
    (cls,) = text_model.embed([[1, 5, 6]], pooling=Pooling("cls", normalize=False))
    assert len(cls) == 64
