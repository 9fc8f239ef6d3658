"""The Grafana dashboard and the HPA only query metrics a real `tokenmill serve` exports.

tests/deploy/test_deploy.py checks the dashboard against a hand-written list of metric names; this test
checks it against the server itself: send the test server a completion, scrape /metrics with the
official Prometheus parser and compare the metric families.
"""

from __future__ import annotations

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_deploy import DASHBOARD, K8S, dashboard_metrics
from tests.utils.server import ServerProcess

# Exported only when torch sees a CUDA device (tokenmill/server/metrics.py `_GpuProbe`).
GPU_ONLY = frozenset({"tokenmill_gpu_memory_used_bytes", "tokenmill_gpu_utilization_ratio"})


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def exported_families(text: str) -> set[str]:
    """Every name a PromQL query could use for the scrape: family names plus sample names
    (`x_bucket`/`x_sum`/`x_count` of histograms, `x_total` of counters, whose family is `x`)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        names.update(s.name for s in family.samples)
    return names


def hpa_pod_metrics() -> set[str]:
    hpa = yaml.safe_load((K8S / "base" / "hpa.yaml").read_text())
    return {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}


@pytest.fixture(scope="module")
def scrape(server: ServerProcess) -> str:
    """/metrics of the shared test server after a completion it served."""
    model = httpx.get(f"{server.base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=60.0,
        json={"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10.0)
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    return metrics.text


def test_dashboard_uses_metrics(scrape):
    wanted = dashboard_metrics(DASHBOARD)
    assert len(wanted) >= 10, f"dashboard parse looks wrong: {sorted(wanted)}"


def test_every_dashboard_metric_is_exported(scrape):
    wanted = dashboard_metrics(DASHBOARD)
    exported = exported_families(scrape)
    missing = wanted - exported
    if _cuda():
        assert not missing, f"dashboard metrics not exported by the server: {sorted(missing)}"
    else:
        # On CPU exactly the GPU gauges are absent, and nothing else.
        assert missing == (GPU_ONLY & wanted), f"dashboard metrics not exported on CPU: {sorted(missing - GPU_ONLY)}"
        assert not (GPU_ONLY & exported), "GPU metrics exported without a GPU"


def test_histograms_export_buckets(scrape):
    families = {f.name: f for f in text_string_to_metric_families(scrape)}
    for name in dashboard_metrics(DASHBOARD):
        family = families.get(name)
        if family is not None and family.type == "histogram":
            sample_names = {s.name for s in family.samples}
            assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= sample_names, name


def test_served_request_is_counted(scrape):
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(scrape)
        for s in f.samples
    }
    ok = [
        v for (name, labels), v in samples.items() if name == "tokenmill_requests_total" and ("status", "ok") in labels
    ]
    assert sum(ok) >= 1
    assert samples[("tokenmill_generation_tokens_total", ())] >= 1


def test_hpa_custom_metric_is_exported(scrape):
    wanted = hpa_pod_metrics()
    assert wanted, "the HPA has no Pods metric"
    families = {f.name: f for f in text_string_to_metric_families(scrape)}
    for name in wanted:
        assert name in families, f"HPA metric {name} not exported"
        assert families[name].type == "gauge"
        assert [s for s in families[name].samples if s.name == name], f"{name} has no sample"
