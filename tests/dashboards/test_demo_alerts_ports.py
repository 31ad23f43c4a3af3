"""How ``dashboards/demo_alerts.py`` gives each scenario's job its own endpoints (no server here;
the alerts themselves: test_demo_alerts.py)."""

from __future__ import annotations

import importlib.util
import socket
import sys

import pytest
from dashboards_support import DASHBOARDS  # conftest.py puts this folder on sys.path


def test_no_two_jobs_are_handed_the_same_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probed port is free again at once, and the system may hand it out twice: two scenarios'
    jobs scraping one endpoint see each other's alerts (a healthy run "firing" the tiny-lr alert).
    With the system answering every probe with the same port, the second request is refused
    rather than given the first one's ports."""
    spec = importlib.util.spec_from_file_location("demo_alerts_script", DASHBOARDS / "demo_alerts.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up
    spec.loader.exec_module(script)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]

    class SamePort(socket.socket):
        def bind(self, address: object) -> None:
            host, port = address  # type: ignore[misc]
            super().bind((host, port or base))

    monkeypatch.setattr(script.socket, "socket", SamePort)
    taken: set[int] = set()
    first = script._free_ports(2, taken)
    assert first == [base, base + 1] and taken == {base, base + 1}, f"first ports {first}, taken {taken}"
    with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
        got = script._free_ports(2, taken)
        pytest.fail(f"the second job was handed ports {got} although {sorted(taken)} are taken")
