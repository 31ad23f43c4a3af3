"""Duration measurement that never stalls the training loop.

On CPU a duration is two ``time.perf_counter`` reads. On CUDA the host returns long before
the kernels finish, so host time says little; instead a pair of ``torch.cuda.Event`` is
recorded on the current stream and read back later, once the end event has completed
(polled without blocking at the next step) or at flush/shutdown. ``torch.cuda`` is touched
only when the optimizer's parameters live on a CUDA device.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

RecordFn = Callable[[float], None]

# Pairs still in flight. A step older than this is certainly done on the device, so the
# rare wait for it costs nothing in practice and bounds memory if polling ever falls behind.
MAX_PENDING_EVENT_PAIRS = 64


class DurationRecorder(Protocol):
    """Measures spans of host code and hands each duration (seconds) to a record function."""

    def start(self) -> Any:
        """Mark the beginning; returns a token for :meth:`stop`."""

    def stop(self, token: Any) -> None:
        """Mark the end of the interval started with ``token``."""

    def poll(self) -> None:
        """Record whatever finished since the last call, without blocking."""

    def flush(self) -> None:
        """Record everything still pending; may wait for the device (off the hot path only)."""


class HostDurationRecorder:
    """Wall-clock durations from ``time.perf_counter``, recorded immediately."""

    __slots__ = ("_record",)

    def __init__(self, record: RecordFn) -> None:
        self._record = record

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, token: float) -> None:
        self._record(time.perf_counter() - token)

    def poll(self) -> None:
        pass

    def flush(self) -> None:
        pass


class DeviceEventDurationRecorder:
    """Device durations from event pairs, read back lazily.

    Args:
        record: Receives each duration in seconds.
        event_factory: Creates a timing event; ``torch.cuda.Event(enable_timing=True)`` by
            default. Tests pass fakes, which is why nothing here names CUDA directly.
        max_pending: Pairs allowed in flight before the oldest is waited for.
    """

    def __init__(
        self,
        record: RecordFn,
        event_factory: Callable[[], Any] | None = None,
        max_pending: int = MAX_PENDING_EVENT_PAIRS,
    ) -> None:
        self._record = record
        self._factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._max_pending = max_pending
        self._pending: deque[tuple[Any, Any]] = deque()
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def _event(self) -> Any:
        # Reuse read events: creating CUDA events every step is measurable at our budget.
        return self._free.pop() if self._free else self._factory()

    def start(self) -> Any:
        event = self._event()
        event.record()
        return event

    def stop(self, token: Any) -> None:
        end = self._event()
        end.record()
        with self._lock:
            self._pending.append((token, end))
            if len(self._pending) > self._max_pending:
                self._resolve_oldest(wait=True)

    def _resolve_oldest(self, wait: bool) -> bool:
        begin, end = self._pending[0]
        if wait:
            end.synchronize()
        elif not end.query():
            return False
        self._pending.popleft()
        self._record(begin.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
        self._free.extend((begin, end))
        return True

    def poll(self) -> None:
        with self._lock:
            while self._pending and self._resolve_oldest(wait=False):
                pass

    def flush(self) -> None:
        with self._lock:
            while self._pending:
                self._resolve_oldest(wait=True)

    @property
    def pending(self) -> int:
        """Event pairs not yet read back."""
        return len(self._pending)


def duration_recorder_for(device: torch.device, record: RecordFn) -> DurationRecorder:
    """The recorder suited to tensors on ``device``.

    Only CUDA gets event timing; on other devices host time is the best available and is
    what is recorded.
    """
    if device.type == "cuda":
        return DeviceEventDurationRecorder(record)
    return HostDurationRecorder(record)
