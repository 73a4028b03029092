"""A mixture-of-experts model served: router statistics in /metrics when asked for."""

from __future__ import annotations

from live_server import MODEL_NAME, running_server, scrape
from openai import OpenAI


def test_router_statistics_reach_metrics(tiny_model_dir) -> None:
    with running_server(tiny_model_dir("mixtral"), {"moe_router_stats": True}) as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4)
        metrics = scrape(srv.url)
    per_layer = {
        layer: sum(
            v
            for k, v in metrics.items()
            if k.startswith("tokenmill:moe_expert_tokens_total{") and f"layer={layer}" in k
        )
        for layer in (0, 1)
    }
    assert per_layer[0] == per_layer[1] > 0
    assert per_layer[0] % 2 == 0  # top-2: each token counted twice
