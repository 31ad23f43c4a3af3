"""A rank's Prometheus endpoint serves its final values until Prometheus has scraped them.

Scrapes here are plain HTTP requests of the endpoint, as Prometheus makes them; what counts is a
scrape that began after the final values were recorded and whose response was sent whole.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import pytest
from fsdp_patch.telemetry.export.prometheus_endpoint import PrometheusEndpoint, wait_for_final_scrapes
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.registry import Collector

WAIT_S = 60.0  # a bound for waits that the test itself ends by scraping; never reached when right


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def endpoint(registry: CollectorRegistry) -> Iterator[PrometheusEndpoint]:
    served = PrometheusEndpoint("127.0.0.1", 0, registry)
    yield served
    served.stop()


def scrape(endpoint: PrometheusEndpoint) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=30) as response:
        return response.read().decode()


class Waiter(threading.Thread):
    """``wait_for_final_scrapes`` on its own thread, as a rank's shutdown runs it."""

    def __init__(self, endpoint: PrometheusEndpoint, wanted: int | None, timeout_s: float = WAIT_S) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.wanted, self.timeout_s = endpoint, wanted, timeout_s
        self.warnings: list[str] = []
        self.said: list[str] = []
        self.marked = threading.Event()
        self.result: int | None = None

    def run(self) -> None:
        original = self.endpoint.mark

        def mark() -> None:
            original()
            self.marked.set()

        self.endpoint.mark = mark  # type: ignore[method-assign]
        wait_for_final_scrapes([self.endpoint], self.wanted, self.timeout_s, 0, self.warnings.append, self.said.append)
        self.marked.set()  # also when nothing was marked

    def finished(self) -> bool:
        self.join(WAIT_S)
        return not self.is_alive()


def test_the_endpoint_waits_for_the_scrapes_asked_for_and_they_carry_the_final_values(
    endpoint: PrometheusEndpoint, registry: CollectorRegistry
) -> None:
    steps = Counter("steps", "optimizer steps", registry=registry)
    steps.inc(20)  # the final value, recorded before the wait
    waiter = Waiter(endpoint, wanted=2)
    waiter.start()
    assert waiter.marked.wait(WAIT_S), "the wait never began"
    bodies = [scrape(endpoint), scrape(endpoint)]
    assert waiter.finished(), "the wait went on after the two scrapes it asked for"
    assert waiter.warnings == [], f"want no warning, got {waiter.warnings}"
    for body in bodies:
        assert "steps_total 20.0" in body, f"a final scrape did not carry the final value:\n{body}"
    assert endpoint.answered == 2, f"want 2 scrapes answered, got {endpoint.answered}"
    want = f"rank 0 serves its final metrics on port {endpoint.port} until Prometheus has scraped them 2 time(s)"
    assert len(waiter.said) == 1 and want in waiter.said[0], f"want one line saying {want!r}, got {waiter.said}"


class Blocking(Collector):
    """Holds a scrape inside its collection until released, to begin a scrape before a mark."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def collect(self) -> Iterator:
        self.entered.set()
        self.release.wait(WAIT_S)
        return iter(())


def test_a_scrape_begun_before_the_final_values_does_not_count(
    endpoint: PrometheusEndpoint, registry: CollectorRegistry
) -> None:
    blocking = Blocking()
    registry.register(blocking)
    early = threading.Thread(target=scrape, args=(endpoint,), daemon=True)
    early.start()
    assert blocking.entered.wait(WAIT_S), "the early scrape never reached the registry"
    endpoint.mark()  # the final values are recorded while the early scrape is being collected
    blocking.release.set()
    early.join(WAIT_S)
    got = endpoint.wait_for_scrapes(1, timeout_s=0.5)
    assert got == 0, f"a scrape begun before the mark counted: want 0, got {got}"
    registry.unregister(blocking)
    scrape(endpoint)
    got = endpoint.wait_for_scrapes(1, timeout_s=WAIT_S)
    assert got == 1, f"a scrape begun after the mark: want 1, got {got}"


def test_by_default_an_endpoint_nobody_scraped_does_not_wait(endpoint: PrometheusEndpoint) -> None:
    waiter = Waiter(endpoint, wanted=None)
    waiter.start()
    assert waiter.finished(), "an endpoint nobody scraped waited at exit"
    assert waiter.warnings == [] and waiter.said == [], f"want nothing said, got {waiter.said + waiter.warnings}"


def test_by_default_a_scraped_endpoint_waits_for_one_scrape_of_its_final_values(endpoint: PrometheusEndpoint) -> None:
    scrape(endpoint)  # scraped during the run
    waiter = Waiter(endpoint, wanted=None)
    waiter.start()
    assert waiter.marked.wait(WAIT_S), "the wait never began"
    scrape(endpoint)
    assert waiter.finished(), "the wait went on after the final scrape"
    assert endpoint.answered == 2, f"want 2 scrapes answered, got {endpoint.answered}"


def test_a_final_scrape_that_never_comes_is_waited_for_within_the_bound_and_named(endpoint: PrometheusEndpoint) -> None:
    waiter = Waiter(endpoint, wanted=1, timeout_s=0.2)
    waiter.start()
    assert waiter.finished(), "the wait outlived its bound"
    (warning,) = waiter.warnings
    want = f"rank 0: Prometheus scraped the final values of port {endpoint.port} 0 of 1 time(s) within 0.2 s"
    assert want in warning and "FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT" in warning, (
        f"want {want!r} and the setting named, got {warning!r}"
    )


def test_a_favicon_request_is_no_scrape(endpoint: PrometheusEndpoint) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/favicon.ico", timeout=30) as response:
        response.read()
    assert endpoint.answered == 0, f"want no scrape counted for /favicon.ico, got {endpoint.answered}"
