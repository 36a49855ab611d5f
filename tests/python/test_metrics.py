"""`serve --metrics-addr` (docs/metrics.md): the exposition parses with the reference parser
(prometheus_client's text_string_to_metric_families) and carries the attaches made."""

from __future__ import annotations

import re
import time
import urllib.request

import weightcache
from conftest import import_tool

prometheus_parser = import_tool("prometheus_client.parser")


def _metrics_url(daemon, timeout=30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"metrics at (http://127\.0\.0\.1:\d+/metrics)", daemon.log_text())
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError(f"no metrics line: {daemon.log_text()}")


def test_metrics_exposition_parses_with_prometheus_client(serve, checkpoint, runtime_dir):
    model_dir, _ = checkpoint
    daemon = serve(model_dir, "--metrics-addr", "127.0.0.1:0")  # wait_ready attaches once
    url = _metrics_url(daemon)
    att = weightcache.attach(str(model_dir), tier="host", runtime_dir=runtime_dir,
                             on_missing="error")
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = response.read().decode()
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}

    # prometheus_client strips the _total suffix from counter family names.
    attaches = {s.labels["result"]: s.value for s in families["weightcache_attaches"].samples
                if s.name == "weightcache_attaches_total"}
    assert attaches["daemon"] == 2
    assert set(attaches) == {"daemon", "mismatch", "unavailable", "error"}
    assert families["weightcache_hits"].samples[0].value == 2

    (cache_bytes,) = families["weightcache_cache_bytes"].samples
    assert cache_bytes.labels["device"] == "host"
    assert cache_bytes.labels["tier"] == "host"
    assert cache_bytes.labels["model"]
    assert cache_bytes.value > 0

    hist = families["weightcache_attach_duration_seconds"]
    assert hist.type == "histogram"
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 2
    counts = [s.value for s in buckets]
    assert counts == sorted(counts)  # cumulative

    states = {s.labels["state"]: s.value for s in families["weightcache_daemon_state"].samples}
    assert states == {"loading": 0, "awaiting": 0, "ready": 1, "failed": 0, "draining": 0,
                      "demoted": 0}
    for name in ("weightcache_evictions", "weightcache_demotions", "weightcache_promotions"):
        assert families[name].type == "counter"
        assert families[name].samples[0].value == 0
    del att
