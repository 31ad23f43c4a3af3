"""Each rank names its Prometheus endpoint in one line that another rank's output cannot split.

Ranks share the job's stderr pipe. A line written as two writes (text, then newline, as ``print``
does) lets another rank's line land between them, and a reader then sees one endpoint, not two.
"""

from __future__ import annotations

import io

import pytest

pytest.importorskip("opentelemetry.exporter.prometheus")

from fsdp_patch.telemetry.export.exporters import MetricSetup, _start_prometheus
from fsdp_patch.telemetry.export.ranks import RankInfo
from prometheus_client import CollectorRegistry

from dashboards.demo_alerts import _ENDPOINT


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_the_endpoint_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    writes = _Writes()
    monkeypatch.setattr("sys.stderr", writes)
    setup = MetricSetup()
    _start_prometheus(RankInfo(rank=3, world_size=4, local_rank=0, run_id=None), setup, CollectorRegistry())
    try:
        lines = [call for call in writes.calls if "serves Prometheus metrics at" in call]
        assert len(lines) == 1 and lines[0].endswith("\n"), f"want one write ending in a newline, got {writes.calls}"
        port = setup.prometheus_endpoints[0].port
        want = f"fsdp_patch telemetry: rank 3 serves Prometheus metrics at http://127.0.0.1:{port}/metrics\n"
        assert lines[0] == want, f"want {want!r}, got {lines[0]!r}"
    finally:
        for endpoint in setup.prometheus_endpoints:
            endpoint.stop()


def test_the_demo_reads_every_endpoint_of_interleaved_lines() -> None:
    rank0 = "fsdp_patch telemetry: rank 0 serves Prometheus metrics at http://127.0.0.1:9464/metrics"
    rank1 = "fsdp_patch telemetry: rank 1 serves Prometheus metrics at http://127.0.0.1:9465/metrics"
    got = _ENDPOINT.findall(rank0 + rank1 + "\n")
    want = ["http://127.0.0.1:9464/metrics", "http://127.0.0.1:9465/metrics"]
    assert got == want, f"want {want}, got {got}"
