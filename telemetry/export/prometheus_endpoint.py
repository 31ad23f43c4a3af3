"""A rank's Prometheus pull endpoint, which knows which scrapes it has answered.

A pull endpoint loses what a job records after its last scrape: a short run, or the last
interval of a long one, never reaches Prometheus or its alert rules, and a NaN found at the
final step fires no alert. So the endpoint counts the scrapes it has answered in full, and at
shutdown a rank serves its final values until Prometheus has scraped them
(:func:`wait_for_final_scrapes`, bounded by ``FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT``).

Alternatives considered:
    - ``prometheus_client.start_http_server``: serves the registry, but says nothing of the
      scrapes it answers.
    - A collector registered beside the reader's that notes each collection: it runs before the
      response is written, so a rank could exit while its final values were still being sent.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

if TYPE_CHECKING:  # the ``prometheus`` extra: imported where an endpoint is made
    from prometheus_client import CollectorRegistry


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    # A scrape in progress must not keep the process alive once the endpoint is stopped.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A line per scrape on stderr would drown the job's own output."""


class _Answered:
    """The response body; ``close`` reports whether it was sent whole.

    wsgiref's handler writes each chunk as it takes it and calls ``close`` after the last one
    or after a failed write; the iterator is exhausted only in the first case.
    """

    def __init__(self, body: Iterable[bytes], done: Callable[[bool], None]) -> None:
        self._body = iter(body)
        self._done = done
        self._exhausted = False

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._body)
        except StopIteration:
            self._exhausted = True
            raise

    def close(self) -> None:
        self._done(self._exhausted)


class PrometheusEndpoint:
    """``/metrics`` of one registry over HTTP on a daemon thread, counting the scrapes answered.

    A scrape counts once its response was written whole. :meth:`mark` starts a new period:
    only scrapes that begin after it count towards :meth:`wait_for_scrapes`.

    Raises:
        OSError: The address cannot be bound.
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        from prometheus_client import make_wsgi_app

        family, address = _best_family(host, port)
        server_class = type("_Server", (_ThreadingServer,), {"address_family": family})
        self._metrics = make_wsgi_app(registry)
        self._changed = threading.Condition()
        self._period = 0
        self._answered_in_period = 0
        self.answered = 0
        self._server: WSGIServer = make_server(address, port, self._app, server_class, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fsdp_patch-prometheus", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with self._changed:
            period = self._period
        status: list[str] = []

        def record_status(code: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status.append(code)
            return start_response(code, headers, exc_info)

        body = self._metrics(environ, record_status)
        is_scrape = environ.get("PATH_INFO") != "/favicon.ico"
        return _Answered(body, lambda whole: self._answered(period, whole and is_scrape and status[:1] == ["200 OK"]))

    def _answered(self, period: int, counts: bool) -> None:
        if not counts:
            return
        with self._changed:
            self.answered += 1
            if period == self._period:
                self._answered_in_period += 1
            self._changed.notify_all()

    def mark(self) -> None:
        """Start counting afresh: scrapes that began before now no longer count."""
        with self._changed:
            self._period += 1
            self._answered_in_period = 0

    def wait_for_scrapes(self, count: int, timeout_s: float) -> int:
        """Wait until ``count`` scrapes begun since :meth:`mark` were answered, at most ``timeout_s``.

        Returns:
            How many were answered (``count`` or fewer when the time ran out).
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._answered_in_period < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._answered_in_period

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()


def _best_family(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    # HTTPServer binds IPv4 by default, which fails for an IPv6 host such as "::1".
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, str(sockaddr[0])


def wait_for_final_scrapes(
    endpoints: list[PrometheusEndpoint],
    wanted: int | None,
    timeout_s: float,
    rank: int,
    warn: Callable[[str], None],
    say: Callable[[str], None] | None = None,
) -> None:
    """Serve the final values until each endpoint has answered ``wanted`` scrapes of them.

    Called once nothing more is recorded. ``wanted`` ``None`` (the default setting) waits for
    one scrape on an endpoint that was scraped during the run, and not at all on one nobody
    scrapes; an explicit number waits regardless. The endpoints are waited for side by side,
    at most ``timeout_s`` in all. ``say`` hears that a wait begins (a job that pauses at its end
    says why); ``warn`` that the time ran out.
    """
    for endpoint in endpoints:
        endpoint.mark()
    deadline = time.monotonic() + timeout_s
    for endpoint in endpoints:
        count = (1 if endpoint.answered else 0) if wanted is None else wanted
        if count == 0:
            continue
        if say is not None:
            say(
                f"fsdp_patch telemetry: rank {rank} serves its final metrics on port {endpoint.port} until Prometheus "
                f"has scraped them {count} time(s), at most {timeout_s:g} s (FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES=0: no wait)"
            )
        got = endpoint.wait_for_scrapes(count, max(0.0, deadline - time.monotonic()))
        if got < count:
            warn(
                f"fsdp_patch telemetry: rank {rank}: Prometheus scraped the final values of port {endpoint.port} "
                f"{got} of {count} time(s) within {timeout_s:g} s (FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT); "
                "what was recorded since the last scrape is not in Prometheus."
            )
