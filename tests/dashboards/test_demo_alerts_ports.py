"""How ``dashboards/demo_alerts.py`` gives each scenario's job its own endpoints (no server here;
the alerts themselves: test_demo_alerts.py)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest
from dashboards_support import DASHBOARDS  # conftest.py puts this folder on sys.path


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo_alerts_script", DASHBOARDS / "demo_alerts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _free_base() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_no_two_jobs_are_handed_the_same_ports(script: ModuleType) -> None:
    """A probed port is free again at once, and a draw may come out the same twice: two scenarios'
    jobs scraping one endpoint see each other's alerts (a healthy run "firing" the tiny-lr alert).
    With every draw the same port, the second request is refused rather than given the first
    one's ports."""
    base = _free_base()
    taken: set[int] = set()
    first = script._free_ports(2, taken, choose=lambda low, high: base)
    assert first == [base, base + 1] and taken == {base, base + 1}, f"first ports {first}, taken {taken}"
    with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
        got = script._free_ports(2, taken, choose=lambda low, high: base)
        pytest.fail(f"the second job was handed ports {got} although {sorted(taken)} are taken")


def test_ports_are_drawn_below_the_range_the_system_hands_out(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The system takes local ports for connections (Prometheus's scrapes, gloo's) from its ephemeral
    range; a rank's port taken that way between the draw and the run leaves the rank without an
    endpoint. Draws are made below the range's start, read from the system."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(script, "EPHEMERAL_RANGE", ranges)
    bounds: list[tuple[int, int]] = []

    def choose(low: int, high: int) -> int:
        bounds.append((low, high))
        return low + 123 * len(bounds)  # another base after a refusal (a port someone holds)

    ports = script._free_ports(4, set(), choose=choose)
    assert bounds[0] == (script.PORT_POOL_START, 40000 - 4), f"drawn between {bounds[0]}"
    assert ports == list(range(ports[0], ports[0] + 4)) and ports[-1] < 40000, f"ports {ports}"
    ranges.write_text("not a range\n")
    assert script._ephemeral_start() == 49152, "an unreadable range is IANA's, from 49152"
