"""A collector that takes requests and never answers them, on loopback.

An exporter sending to it waits until its own timeout (``OTEL_EXPORTER_OTLP_TIMEOUT``). Set that
far beyond the test's bounds, and whatever returns while a request is still open here was not
waiting for the collector: a bound proved by a condition, not by a clock.
"""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType

# Longer than any test runs: an exporter that waited for this collector would outlive the test.
EXPORTER_TIMEOUT_S = 3600
BOUND_S = 120.0  # for waits that the collector's first request ends within seconds


class SilentCollector:
    """Accepts connections, reads what they send, answers nothing; closes them all on exit."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._changed = threading.Condition()
        self._open: set[socket.socket] = set()
        self.requests = 0  # connections that sent something
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="silent-collector", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    connection, _ = self._listener.accept()
                    connection.setblocking(False)
                    self._selector.register(connection, selectors.EVENT_READ, data=False)
                    with self._changed:
                        self._open.add(connection)
                    continue
                try:
                    received = sock.recv(65536)
                except OSError:
                    received = b""
                with self._changed:
                    if received and not key.data:
                        self.requests += 1
                        self._selector.modify(sock, selectors.EVENT_READ, data=True)
                    elif not received:
                        self._selector.unregister(sock)
                        self._open.discard(sock)
                        sock.close()
                    self._changed.notify_all()

    def open_connections(self) -> int:
        """Connections still open: their senders are still waiting for an answer."""
        with self._changed:
            return len(self._open)

    def wait_until_idle(self, timeout_s: float = BOUND_S) -> bool:
        """Wait until every sender has given up (closed its connection)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._open, timeout_s)

    def wait_for_request(self, timeout_s: float = BOUND_S) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.requests > 0, timeout_s)

    def __enter__(self) -> SilentCollector:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stopping = True
        self._thread.join(BOUND_S)
        with self._changed:
            for sock in self._open:
                sock.close()
            self._open.clear()
        self._selector.close()
        self._listener.close()
