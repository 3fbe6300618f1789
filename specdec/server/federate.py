"""Several servers' Prometheus expositions as one, each sample labelled with its source.

Replicas behind Ray Serve each keep their own registry (server/metrics.py); `/metrics` on the
shared endpoint answers with all of them: every family once (its HELP and TYPE), its samples
from every replica with a `replica="<id>"` label, as Prometheus federation shows several jobs.
The parsed families are rendered again by prometheus_client itself, so the text follows the
exposition format exactly as a single server's does.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

LABEL = "replica"


class _Families:
    """A collector that yields the given metric families."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge(expositions: dict[str, str]) -> bytes:
    """{source id: exposition text} -> one exposition; families in first-seen order."""
    families = {}
    for source, text in expositions.items():
        for fam in text_string_to_metric_families(text):
            labelled = [s._replace(labels={**s.labels, LABEL: source}) for s in fam.samples]
            if fam.name in families:
                families[fam.name].samples += labelled
            else:
                fam.samples = labelled
                families[fam.name] = fam
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
