"""telemetry/semconv.py against the design page: the one module that spells the names must spell
them as the contract does. Read from design.md where it is at hand (shared/ beside the checkout,
as for the dashboards' own check of the metric table)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsdp_patch.telemetry import semconv

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def design() -> str:
    candidates = [REPO.parent / "shared" / "design.md", REPO / "shared" / "design.md"]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        pytest.skip("design.md (shared/) is not beside this checkout")
    return found.read_text()


def test_span_names_and_step_attributes_are_the_design_pages(design):
    spans_section = design.split("## Spans", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([\w.]+)` \|", spans_section, re.M)
    want = [semconv.SPAN_STEP, *semconv.STEP_PHASE_SPANS, semconv.SPAN_ZERO_GRAD]
    assert names == want, f"design.md spans {names}, semconv {want}"
    listed = spans_section.split("Attributes on `fsdp.optimizer.step`:", 1)[1].split(". `fsdp.params.count` counts", 1)[0]
    attributes = re.findall(r"`([\w.]+)`", listed)
    assert attributes == list(semconv.STEP_ATTRIBUTES), f"design.md {attributes}, semconv {semconv.STEP_ATTRIBUTES}"
    assert f"`{semconv.ATTR_ERROR_TYPE}`" in spans_section


def test_scope_and_entry_point_names_are_the_design_pages(design):
    section = design.split("## Instrumentation conventions", 1)[1].split("\n## ", 1)[0]
    conventions = " ".join(section.split())
    assert f"name `{semconv.SCOPE_NAME}`" in conventions
    assert "entry point `fsdp_patch` in the group `opentelemetry_instrumentor`" in conventions
