"""One /metrics page for many replicas: each replica's Prometheus text, every sample labelled with
`replica`, families merged (one HELP/TYPE per metric)."""

from __future__ import annotations

import time
from typing import Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Merged:
    """A collector that yields already-parsed families (prometheus_client renders them)."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self):
        return iter(self._families)


def merge_replica_metrics(texts: Mapping[str, str]) -> bytes:
    """`texts` maps a replica id to its /metrics text; the result is one exposition where each
    sample carries replica="<id>". A replica's text that does not parse is left out (and named in
    quill_cluster_metrics_unparsed)."""
    families: dict[str, Metric] = {}
    unparsed = []
    for replica, text in sorted(texts.items()):
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            unparsed.append(replica)
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, REPLICA_LABEL: replica}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
    replicas = Metric("quill_cluster_replicas_reporting", "Replicas whose metrics this page holds.", "gauge")
    replicas.add_sample("quill_cluster_replicas_reporting", {}, float(len(texts) - len(unparsed)))
    out = [replicas, *families.values()]
    if unparsed:
        bad = Metric("quill_cluster_metrics_unparsed", "Replicas whose metrics text did not parse.", "gauge")
        for replica in unparsed:
            bad.add_sample("quill_cluster_metrics_unparsed", {REPLICA_LABEL: replica}, 1.0)
        out.append(bad)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(out))
    return generate_latest(registry)


class MetricsBoard:
    """The latest /metrics text of each replica, as replicas push it; a replica silent for
    `stale_s` (dead, or removed by autoscaling) drops off the page."""

    def __init__(self, stale_s: float = 10.0, clock=time.monotonic):
        self.stale_s = stale_s
        self._clock = clock
        self._texts: dict[str, tuple[float, str]] = {}

    def push(self, replica: str, text: str) -> None:
        self._texts[replica] = (self._clock(), text)

    def remove(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def texts(self) -> dict[str, str]:
        now = self._clock()
        for replica in [r for r, (at, _) in self._texts.items() if now - at > self.stale_s]:
            del self._texts[replica]
        return {replica: text for replica, (_, text) in self._texts.items()}
