"""LLM: offline batch generation, ``LLM(model=...).generate(prompts, sampling_params)``, and
embeddings, ``LLM(model=...).embed(prompts)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenmill.engine import LLMEngine
from tokenmill.engine.llm_engine import PreparedRequest
from tokenmill.outputs import RequestOutput
from tokenmill.pooling import Pooling
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching.

    ``engine_args`` are EngineArgs fields (max_model_len, kv_cache_memory, max_num_seqs, ...).
    """

    def __init__(self, model: str = "gemma-3-270m", **engine_args: object) -> None:
        self.engine = LLMEngine.from_args(model=model, **engine_args)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt is validated before any is queued, so a bad one raises ValueError and
        leaves the engine untouched.
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts; "
                    "pass one SamplingParams or one per prompt"
                )
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        for sp in params_list:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams; got {type(sp).__name__}")
        # Only each request's final output is read: the engine builds no other (vLLM's LLM
        # does the same), which saves a RequestOutput a request a step.
        final_only = [
            dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params_list
        ]
        prepared = [self.engine.prepare_request(p, sp) for p, sp in zip(prompt_list, final_only)]
        return self._run(prepared, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.tokenizer.encode_chat(conv, add_generation_prompt)  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: Pooling | None = None,
        use_tqdm: bool = True,
    ) -> list[list[float]]:  # fmt: skip
        """Each prompt's embedding (pooling.py), in input order: by ``pooling``, else the
        model's (an embedding checkpoint's, or task="embed"'s last-token default)."""
        pooling = pooling or self.engine.info.pooling
        if pooling is None:
            raise ValueError(
                f"{self.engine.info.model} is a text model: pass pooling=Pooling(...) or load it "
                'with task="embed"'
            )
        params = SamplingParams(pooling=pooling, output_kind=RequestOutputKind.FINAL_ONLY)
        prepared = [self.engine.prepare_request(p, params) for p in _as_prompt_list(prompts)]
        outs = self._run(prepared, use_tqdm)
        return [out.embedding for out in outs if out.embedding is not None]

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _run(self, prepared: list[PreparedRequest], use_tqdm: bool) -> list[RequestOutput]:
        ids = [self.engine.add_request(p) for p in prepared]
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(prepared) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(prepared), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in finished:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    out = list(prompts)
    if not out:
        raise ValueError("prompts must not be empty")
    return out
