"""Reading a daemon's Prometheus endpoint back into a dict (tests, benchmarks)."""

from __future__ import annotations


def scrape(port: int, host: str = "127.0.0.1", token: str = "") -> dict[str, float]:
    """A daemon's Prometheus samples as {"name{label=value,...}": value} (tests, benchmarks)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"http://{host}:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    text = urllib.request.urlopen(request, timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
