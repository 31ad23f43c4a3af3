"""Failure isolation: an exporter that raises, hangs or cannot write (a silent collector, an unwritable
directory, a full disk, a full queue) never reaches training, and is reported once."""

from __future__ import annotations

import logging
import os
import threading
import time

import fsdp_patch.telemetry as telemetry
import pytest
from export_testing import run_steps, telemetry_warnings
from fsdp_patch.telemetry import OptimizerObserver, semconv
from fsdp_patch.telemetry.export import providers, trace_files
from fsdp_patch.telemetry.export.isolation import GuardedSpanExporter, WarnOnce, run_bounded
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from telemetry_testing import fake_optimizer

from tests.silent_collector import BOUND_S, SilentCollector

# -- failure isolation ----------------------------------------------------------------


class RaisingExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        raise ConnectionError("collector is gone")

    def shutdown(self):
        raise OSError("cannot close")


def test_raising_exporter_never_reaches_training_and_warns_once(otel, caplog, tmp_path):
    raising = RaisingExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(GuardedSpanExporter(raising), schedule_delay_millis=10))
    observer = OptimizerObserver(
        fake_optimizer(), precision_aware=False, tracer_provider=provider, meter_provider=otel.meter_provider
    )
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            run_steps(observer, 2)
            provider.force_flush()
        provider.shutdown()
    assert raising.calls >= 3
    messages = telemetry_warnings(caplog)
    assert len(messages) == 1, messages
    assert "RaisingExporter failed to export spans (ConnectionError: collector is gone)" in messages[0]
    assert otel.points()[semconv.METRIC_STEP_DURATION][0].count == 6  # metrics unaffected


def test_a_silent_collector_holds_neither_the_steps_nor_the_end_and_is_reported_once(monkeypatch, caplog):
    with SilentCollector() as collector:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        # Ten times the flush budget: an exporter waiting for the collector is still waiting when
        # flush and shutdown return, and gives up before the test ends.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
        monkeypatch.setenv("FSDP_PATCH_FLUSH_TIMEOUT", "0.5")
        observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
        with caplog.at_level(logging.WARNING):
            run_steps(observer, 3)
            assert collector.wait_for_request(), "the exporters never reached the collector"
            run_steps(observer, 3)  # they return while an export is waiting: it runs off the training thread
            providers.flush()
            run_steps(observer, 3)
            telemetry.shutdown()
            waiting = collector.open_connections()
            until_shutdown = list(caplog.records)
        assert waiting > 0, "flush and shutdown returned only once the exporters had given up on the collector"
        # The exporters' threads end on their own timeout, not on a connection the test cuts (whose
        # retries would log into later tests).
        assert collector.wait_until_idle(), "the exporters never gave up on the silent collector"
    messages = telemetry_warnings(caplog)
    span_reports = [m for m in messages if "OTLPSpanExporter failed to export spans" in m]
    metric_reports = [m for m in messages if "OTLPMetricExporter failed to export metrics" in m]
    timeouts = [m for m in messages if "did not finish within 0.5s" in m]
    assert len(span_reports) <= 1 and len(metric_reports) <= 1, f"want each exporter reported once at most: {messages}"
    assert timeouts, f"want the budget named where the collector held the flush: {messages}"
    # OpenTelemetry's own retry warnings were folded into those reports while telemetry ran.
    theirs = [
        r.getMessage() for r in until_shutdown if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING
    ]
    assert theirs == [], f"want OpenTelemetry's own warnings folded into ours, got {theirs}"


def test_unwritable_trace_dir_warns_once(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FSDP_PATCH_TRACE_DIR", str(blocker / "traces"))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            run_steps(observer, 1)
            providers.flush()
        telemetry.shutdown()
    messages = telemetry_warnings(caplog)
    # Warnings of other origin (a thread an earlier test left behind) are not this test's subject.
    about_dir = [m for m in messages if "a_file" in m or "TraceFileSpanExporter" in m]
    assert len(about_dir) == 1, f"want one warning about the unwritable trace dir, got {about_dir}; all: {messages}"
    assert "TraceFileSpanExporter failed to export spans" in about_dir[0] and "a_file" in about_dir[0], about_dir


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to simulate a full disk")
def test_full_disk_warns_once_and_training_continues(tmp_path, caplog, otel):
    (tmp_path / "rank0.trace.json").symlink_to("/dev/full")
    exporter = GuardedSpanExporter(trace_files.TraceFileExporter(str(tmp_path), 0, {}))
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    observer = OptimizerObserver(
        fake_optimizer(), precision_aware=False, tracer_provider=provider, meter_provider=otel.meter_provider
    )
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            run_steps(observer, 1)
            provider.force_flush()
        provider.shutdown()
    messages = telemetry_warnings(caplog)
    assert len(messages) == 1, messages
    assert "No space left on device" in messages[0]


def test_run_bounded_gives_up_waiting_and_warns_once(caplog):
    warn = WarnOnce(logging.getLogger("telemetry.test"))
    with caplog.at_level(logging.WARNING):
        release = threading.Event()
        finished: list[bool] = []

        def slow() -> None:
            release.wait(BOUND_S)
            finished.append(True)

        assert run_bounded(slow, 0.2, "slow flush", warn) is False
        assert run_bounded(slow, 0.2, "slow flush", warn) is False
        assert finished == [], "run_bounded waited for the call it bounds"
        release.set()
        assert run_bounded(lambda: 1 / 0, 1.0, "bad flush", warn) is False
        assert run_bounded(lambda: None, 1.0, "good flush", warn) is True
    messages = telemetry_warnings(caplog)
    assert len(messages) == 2
    assert "slow flush did not finish within 0.2s" in messages[0]
    assert "ZeroDivisionError" in messages[1]


class BlockingExporter(SpanExporter):
    """A collector that hangs: export waits until released."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.entered = threading.Event()
        self.exporting = False
        self.exported_batches = 0

    def export(self, spans):
        self.entered.set()
        self.exporting = True
        self.exported_batches += 1
        self.release.wait(BOUND_S)
        self.exporting = False
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


def test_hanging_exporter_does_not_block_steps_and_queue_overflow_is_reported_once(monkeypatch, caplog):
    from fsdp_patch.telemetry.export import isolation

    monkeypatch.setattr(isolation._ONCE, "_seen", set())  # a fresh "once" for this test
    blocking = BlockingExporter()
    monkeypatch.setattr(providers, "build_span_exporters", lambda info, resource: ([GuardedSpanExporter(blocking)], []))
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("FSDP_PATCH_FLUSH_TIMEOUT", "1")
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    with caplog.at_level(logging.WARNING):
        run_steps(observer, 20)  # 100+ spans into a queue of 8 behind a hung export
        assert blocking.entered.wait(BOUND_S), "nothing was exported"
        assert blocking.exporting, "the steps returned only once the hung export had returned"
        blocking.release.set()
        telemetry.shutdown()
    queue_full = [m for m in telemetry_warnings(caplog) if "Queue full" in m]
    assert len(queue_full) == 1
    assert blocking.exported_batches >= 1


def test_queue_full_warnings_fold_for_our_processors_only(monkeypatch, caplog):
    """Our batch processors' "Queue full" warning shows once per run, beyond the SDK's own 20 s
    window; an application's processor in the same process keeps the SDK's behaviour."""
    from fsdp_patch.telemetry.export.isolation import OwnBatchSpanProcessor

    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])  # the SDK's own filter forgets after 20 s
    counts = {}
    for label, processor_class in (("ours", OwnBatchSpanProcessor), ("application's", BatchSpanProcessor)):
        exporter = BlockingExporter()
        processor = processor_class(exporter, max_queue_size=1, max_export_batch_size=1, schedule_delay_millis=60_000)
        provider = TracerProvider()
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("t")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            tracer.start_span("first").end()
            assert exporter.entered.wait(10), "the exporter never started exporting"
            for _ in range(5):  # queue of 1 behind a hung export: each further span is dropped
                tracer.start_span("more").end()
                now[0] += 40
        counts[label] = sum("Queue full" in r.getMessage() for r in caplog.records)
        exporter.release.set()
        provider.shutdown()
    assert counts["ours"] == 1, f"our processor: want the warning once, got {counts['ours']} times"
    assert counts["application's"] >= 2, f"application's processor: want the SDK's repeats, got {counts}"
