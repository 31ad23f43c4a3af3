"""Deferred device timing (with fake events: no GPU needed) and the CPU path's independence from CUDA."""

from __future__ import annotations

import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.instrumentation import timing
from telemetry_testing import fake_optimizer, run_fake_step


class FakeClock:
    def __init__(self) -> None:
        self.now_ms = 0.0
        self.device_done_ms = 0.0  # the device has executed everything recorded before this time
        self.synchronized = 0


class FakeEvent:
    """Mimics torch.cuda.Event: record() stamps the time, query() says whether the device got there."""

    created = 0

    def __init__(self, clock: FakeClock) -> None:
        FakeEvent.created += 1
        self.clock = clock
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = self.clock.now_ms

    def query(self) -> bool:
        return self.at_ms is not None and self.at_ms <= self.clock.device_done_ms

    def synchronize(self) -> None:
        self.clock.synchronized += 1
        self.clock.device_done_ms = max(self.clock.device_done_ms, self.at_ms)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an event the device has not reached"
        return end.at_ms - self.at_ms


def make_recorder(max_pending: int = 64):
    clock = FakeClock()
    recorded: list[float] = []
    recorder = timing.DeviceEventDurationRecorder(recorded.append, lambda: FakeEvent(clock), max_pending)
    return clock, recorder, recorded


def timed(clock: FakeClock, recorder, duration_ms: float) -> None:
    token = recorder.start()
    clock.now_ms += duration_ms
    recorder.stop(token)
    clock.now_ms += 1.0


def test_device_durations_are_read_later_without_blocking():
    clock, recorder, recorded = make_recorder()
    timed(clock, recorder, 30.0)
    timed(clock, recorder, 50.0)
    recorder.poll()
    assert recorded == [] and recorder.pending == 2  # the device is still busy: nothing read, nothing waited on
    clock.device_done_ms = 35.0  # the first step finished on the device
    recorder.poll()
    assert recorded == [0.030] and recorder.pending == 1
    assert clock.synchronized == 0
    recorder.flush()  # at exit: waits for the rest
    assert recorded == [0.030, 0.050] and recorder.pending == 0
    assert clock.synchronized == 1


def test_events_are_reused_and_pending_pairs_are_bounded():
    FakeEvent.created = 0
    clock, recorder, recorded = make_recorder(max_pending=4)
    for _ in range(10):
        timed(clock, recorder, 2.0)
    assert recorder.pending == 4  # older pairs were waited for instead of piling up
    assert len(recorded) == 6 and all(abs(d - 0.002) < 1e-12 for d in recorded)
    clock.device_done_ms = clock.now_ms
    recorder.poll()
    for _ in range(3):
        timed(clock, recorder, 2.0)
    # 13 timed intervals from 10 events: at most max_pending + 1 pairs ever exist at once
    assert FakeEvent.created == 2 * (4 + 1)


def test_host_recorder_records_immediately():
    recorded: list[float] = []
    recorder = timing.HostDurationRecorder(recorded.append)
    token = recorder.start()
    recorder.stop(token)
    assert len(recorded) == 1 and 0 <= recorded[0] < 1


def test_recorder_choice_follows_the_device():
    assert isinstance(timing.duration_recorder_for(torch.device("cpu"), print), timing.HostDurationRecorder)
    assert isinstance(timing.duration_recorder_for(torch.device("meta"), print), timing.HostDurationRecorder)
    # Choosing (not using) the CUDA recorder touches no CUDA API, so this runs on CPU-only machines.
    assert isinstance(timing.duration_recorder_for(torch.device("cuda", 0), print), timing.DeviceEventDurationRecorder)


def test_cpu_training_never_touches_torch_cuda(make_observer, otel, monkeypatch):
    touched: list[str] = []

    def forbidden(*args, **kwargs):
        touched.append("torch.cuda")
        raise AssertionError("torch.cuda used for CPU tensors")

    for name in ("Event", "synchronize", "current_stream", "is_available", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    observer = make_observer(fake_optimizer("cpu"))
    run_fake_step(observer, [])
    observer.flush_timers()
    assert touched == []
    assert otel.points()[semconv.METRIC_STEP_DURATION][0].count == 1
