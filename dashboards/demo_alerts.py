"""The demo's planted scenarios, scraped by a real Prometheus that evaluates ``prometheus/rules.yml``.

Starts Prometheus on loopback (scrape and rule evaluation every second), then runs
``fsdp-patch demo --scenario S --exporter prometheus`` for each scenario, each on its own pair of
pull endpoints (2 ranks) and its own scrape job named after the scenario, and reports which alerts
fired, at which step, and how long after the run's first step. Exit code 0 when each planted
scenario fired its alert and ``healthy`` fired none, 1 otherwise, 2 for bad input::

    python dashboards/demo_alerts.py                        # 300 steps per scenario
    python dashboards/demo_alerts.py --steps 40 --json out.json

Needs the ``prometheus`` binary (``bash dashboards/install_promtool.sh prometheus`` extracts it
from Debian's package) and fsdp_patch with its ``prometheus`` extra in this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

_ENDPOINT = re.compile(r"serves Prometheus metrics at (http://[^\s/]+/metrics)")

RULES = Path(__file__).resolve().parent / "prometheus" / "rules.yml"
ALERT_GROUP = "fsdp_optimizer.alerts"
# The alert each scenario plants its bug for (healthy: none may fire).
EXPECTED = {
    "nan": "FsdpNonFiniteValues",
    "fp16-overflow": "FsdpRefreshOverflow",
    "tiny-lr": "FsdpLostUpdateRatioHigh",
    "healthy": None,
}
SCRAPE_INTERVAL = "1s"
WORLD_SIZE = 2
POLL_S = 0.25
# Each rank serves its final values for this many scrapes before it exits: alert rules see them
# on the evaluations between the first of those scrapes and the failed scrape after the exit,
# which marks the series stale. A few scrapes leave room for an evaluation that load delays.
FINAL_SCRAPES = 3
# Bounds for conditions that are met within seconds on an idle machine; only a stuck run reaches one.
FINAL_SCRAPE_TIMEOUT_S = 300
SETTLE_TIMEOUT_S = 300


@dataclass
class Fired:
    """An alert seen firing during a scenario's run."""

    alert: str
    ranks: list[str]
    step: int | None
    seconds_after_first_step: float | None


@dataclass
class ScenarioRun:
    """What one scenario's run showed."""

    scenario: str
    expected: str | None
    steps: int
    plant_step: int | None
    endpoints: list[str] = field(default_factory=list)
    service_names: list[str] = field(default_factory=list)
    fired: list[Fired] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        names = {f.alert for f in self.fired}
        return self.expected in names if self.expected else not names


# Ports the demo's ranks serve on are drawn below the range the system hands out on its own
# (connect()'s local ports, bind to port 0): Prometheus's scrape connections and gloo's connections
# take ports from that range, and one taken between the draw and the run would leave a rank without
# an endpoint. Linux says where the range starts; elsewhere it is 49152 (IANA's).
PORT_POOL_START = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _free_ports(count: int, taken: set[int], choose: Callable[[int, int], int] = random.randrange) -> list[int]:
    """``count`` consecutive free loopback ports (a rank r serves on base + r) below the system's
    ephemeral range, none of them in ``taken``, which they are added to: a port is free again
    once probed, and two jobs scraping one endpoint would see each other's alerts."""
    end = _ephemeral_start() - count
    for _ in range(200):
        base = choose(PORT_POOL_START, end) if end > PORT_POOL_START else _any_free_port()
        if base + count > 65535 or taken.intersection(range(base, base + count)):
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            taken.update(range(base, base + count))
            return list(range(base, base + count))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _any_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read().decode())


class Prometheus:
    """A Prometheus server on loopback scraping one job per scenario, with the project's rules."""

    def __init__(self, binary: str, workdir: Path, jobs: dict[str, list[int]]) -> None:
        self.port = _free_ports(1, {port for ports in jobs.values() for port in ports})[0]
        self.url = f"http://127.0.0.1:{self.port}"
        scrape = "\n".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: [{', '.join(repr(f'127.0.0.1:{p}') for p in ports)}]"
            for job, ports in jobs.items()
        )
        config = workdir / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  evaluation_interval: {SCRAPE_INTERVAL}\n"
            f"rule_files:\n  - {json.dumps(str(RULES))}\nscrape_configs:\n{scrape}\n"
        )
        self._log = open(workdir / "prometheus.log", "w", encoding="utf-8")
        self._process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self._process.returncode}; see {workdir / 'prometheus.log'}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready within 60 s")

    def firing(self) -> list[dict[str, Any]]:
        return [a for a in _get(f"{self.url}/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]

    def targets(self, job: str) -> list[dict[str, Any]]:
        return [t for t in _get(f"{self.url}/api/v1/targets")["data"]["activeTargets"] if t["labels"]["job"] == job]

    def last_evaluation(self, group: str) -> float | None:
        """When the rule group's latest evaluation ran (epoch seconds), ``None`` before its first."""
        for entry in _get(f"{self.url}/api/v1/rules")["data"]["groups"]:
            if entry["name"] == group:
                return _epoch(entry.get("lastEvaluation", ""))
        raise RuntimeError(f"prometheus has no rule group {group!r}; rules {RULES}")

    def settle(self, job: str) -> None:
        """Wait until the alert rules have evaluated everything ``job``'s ranks served.

        Once a job has exited, the next scrape of each target fails and marks its series stale:
        an evaluation after that sees none of them. So the rules are done with the job once
        every target is down and the alert group has been evaluated since.
        """
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            targets = self.targets(job)
            scraped = [_epoch(t.get("lastScrape", "")) for t in targets]
            if targets and all(t["health"] == "down" for t in targets) and None not in scraped:
                evaluated = self.last_evaluation(ALERT_GROUP)
                if evaluated is not None and evaluated > max(s for s in scraped if s is not None):
                    return
            time.sleep(POLL_S)
        raise RuntimeError(
            f"job {job}: within {SETTLE_TIMEOUT_S} s, prometheus did not see every target down and evaluate "
            f"{ALERT_GROUP} after that; targets {self.targets(job)}"
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        return _get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")["data"]["result"]

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._log.close()


_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)")


def _epoch(rfc3339: str) -> float | None:
    """Epoch seconds of Prometheus's RFC 3339 times (up to nanoseconds); ``None`` for its zero time."""
    match = _RFC3339.fullmatch(rfc3339 or "")
    if match is None or rfc3339.startswith("0001-"):
        return None
    whole, fraction, offset = match.groups()
    moment = datetime.fromisoformat(whole + ("+00:00" if offset == "Z" else offset))
    return moment.timestamp() + (float(fraction) if fraction else 0.0)


def _last_step(loss_log: Path) -> int | None:
    try:
        lines = loss_log.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return None


def run_scenario(prometheus: Prometheus, scenario: str, steps: int, ports: list[int], workdir: Path) -> ScenarioRun:
    """Run the demo for ``scenario`` and watch Prometheus's alerts while it trains."""
    loss_log = workdir / f"{scenario}.loss.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    env.update(
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(ports[0]),
        FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES=str(FINAL_SCRAPES),
        FSDP_PATCH_PROMETHEUS_FINAL_SCRAPE_TIMEOUT=str(FINAL_SCRAPE_TIMEOUT_S),
    )
    command = [
        sys.executable,
        "-m",
        "fsdp_patch",
        "demo",
        "--scenario",
        scenario,
        "--steps",
        str(steps),
        "--world-size",
        str(WORLD_SIZE),
        "--exporter",
        "prometheus",
        "--progress",
        "none",
        "--trace-dir",
        str(workdir / f"{scenario}.traces"),
        "--loss-log",
        str(loss_log),
    ]
    from fsdp_patch.app.demo.scenarios import SCENARIOS

    plant = max(1, steps // 2) if SCENARIOS[scenario].plant else None  # the demo's default plant step
    result = ScenarioRun(scenario, EXPECTED[scenario], steps, plant)
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            stderr.append(line)
            if "fsdp_patch telemetry" in line and ("cannot" in line or "warning" in line.lower()):
                result.warnings.append(line.strip())
            # Several ranks write to one pipe: read every endpoint a line holds, not one per line.
            result.endpoints.extend(_ENDPOINT.findall(line))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    first_step_at: float | None = None
    seen: dict[str, Fired] = {}
    while True:
        done = process.poll() is not None
        if first_step_at is None and _last_step(loss_log) is not None:
            first_step_at = time.monotonic()
        for alert in prometheus.firing():
            labels = alert["labels"]
            if labels.get("job") != scenario:
                continue
            name = labels["alertname"]
            fired = seen.setdefault(name, Fired(name, [], _last_step(loss_log), None))
            if fired.seconds_after_first_step is None and first_step_at is not None:
                fired.seconds_after_first_step = round(time.monotonic() - first_step_at, 1)
            if labels.get("fsdp_rank") and labels["fsdp_rank"] not in fired.ranks:
                fired.ranks.append(labels["fsdp_rank"])
        if done:
            break
        time.sleep(POLL_S)
    stdout = process.stdout.read() if process.stdout else ""
    reader.join(timeout=10)
    if process.returncode != 0:
        raise RuntimeError(
            f"demo --scenario {scenario} exited {process.returncode}:\n{stdout[-2000:]}\n{''.join(stderr)[-3000:]}"
        )
    prometheus.settle(scenario)
    result.seconds = round(time.monotonic() - started, 1)
    result.service_names = sorted(
        {
            s["metric"].get("service_name", "")
            for s in prometheus.query(f'last_over_time(target_info{{job="{scenario}"}}[30m])')
        }
    )
    # Every evaluation left its ALERTS series behind, also those after the last poll.
    for sample in prometheus.query(f'max_over_time(ALERTS{{job="{scenario}",alertstate="firing"}}[30m])'):
        name, rank = sample["metric"]["alertname"], sample["metric"].get("fsdp_rank", "")
        fired = seen.setdefault(name, Fired(name, [], None, None))
        if rank and rank not in fired.ranks:
            fired.ranks.append(rank)
    result.fired = sorted(seen.values(), key=lambda f: f.alert)
    for fired in result.fired:
        fired.ranks.sort()
    return result


def describe(run: ScenarioRun) -> list[str]:
    want = f"want {run.expected}" if run.expected else "want none"
    planted = f", bug planted at step {run.plant_step}" if run.plant_step else ""
    lines = [
        f"scenario {run.scenario} ({run.steps} steps{planted}, {run.seconds:.0f} s, {want}): "
        f"{'ok' if run.ok else 'NOT AS EXPECTED'}"
    ]
    if not run.fired:
        lines.append("  no alert fired")
    for fired in run.fired:
        when = f"firing at step {fired.step}" if fired.step is not None else "fired"
        after = (
            f", {fired.seconds_after_first_step:.1f} s after the first step"
            if fired.seconds_after_first_step is not None
            else ""
        )
        lines.append(f"  {fired.alert}: {when}{after} (ranks {', '.join(fired.ranks)})")
    lines.append(
        f"  endpoints: {', '.join(run.endpoints) or 'none printed'}; service {', '.join(run.service_names) or '?'}"
    )
    lines.extend(f"  the demo warned: {warning}" for warning in run.warnings)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="demo steps per scenario (default 300)")
    parser.add_argument("--scenarios", default=",".join(EXPECTED), help=f"comma-separated, of {', '.join(EXPECTED)}")
    parser.add_argument("--prometheus", default=None, help="the prometheus binary (default: from PATH)")
    parser.add_argument("--json", default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in EXPECTED]
    if unknown or args.steps < 20:
        print(
            f"demo_alerts.py: {'unknown scenario ' + ', '.join(unknown) if unknown else '--steps must be >= 20'}",
            file=sys.stderr,
        )
        return 2
    binary = args.prometheus or shutil.which("prometheus")
    if binary is None:
        print(
            "demo_alerts.py: no prometheus binary on PATH; install it with "
            "`bash dashboards/install_promtool.sh prometheus` or pass --prometheus PATH",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="fsdp_patch_demo_alerts_") as tmp:
        workdir = Path(tmp)
        taken: set[int] = set()
        ports = {scenario: _free_ports(WORLD_SIZE, taken) for scenario in scenarios}
        prometheus = Prometheus(binary, workdir, ports)
        print(
            f"prometheus at {prometheus.url}: scrape and rule evaluation every {SCRAPE_INTERVAL}, rules {RULES.name}",
            flush=True,
        )
        try:
            runs = []
            for scenario in scenarios:
                run = run_scenario(prometheus, scenario, args.steps, ports[scenario], workdir)
                runs.append(run)
                print("\n".join(describe(run)), flush=True)
        finally:
            prometheus.stop()
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "ok": r.ok} for r in runs], indent=1))
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
