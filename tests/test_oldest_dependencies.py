"""The oldest releases `make test` pins (scripts/oldest-opentelemetry.txt) are pyproject.toml's floors.

A floor raised without the pin (or the reverse) would test releases the package does not declare,
or declare releases no test runs on.
"""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _floors() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    floors = {}
    for text in requirements:
        requirement = Requirement(text)
        for specifier in requirement.specifier:
            if specifier.operator == ">=":
                floors[requirement.name] = specifier.version
    return floors


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "scripts" / "oldest-opentelemetry.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def test_every_opentelemetry_floor_is_pinned_for_the_oldest_environment() -> None:
    floors = {name: version for name, version in _floors().items() if name.startswith("opentelemetry-")}
    pins = _pins()
    declared_but_not_pinned = {
        name: version for name, version in floors.items() if name not in pins or Version(pins[name]) != Version(version)
    }
    assert not declared_but_not_pinned, (
        f"pyproject.toml's floors {declared_but_not_pinned} are not pinned as such in oldest-opentelemetry.txt {pins}"
    )
