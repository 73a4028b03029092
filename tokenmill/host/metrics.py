"""The host's /metrics: every loaded runner's own, merged into one exposition (their samples
carry each runner's ``model_name`` label), and how many models are loaded."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


def merged_metrics(texts: list[str], loaded: list[str]) -> bytes:
    """One exposition of the runners' ``texts``: a family's samples from each, once."""
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            into.samples += family.samples
    models = GaugeMetricFamily("tokenmill:host_loaded_models", "Models loaded now.",
                               labels=["model_name"])  # fmt: skip
    for name in loaded:
        models.add_metric([name], 1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), models]))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics
