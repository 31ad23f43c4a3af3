"""telemetry/semconv.py against docs/conventions.md: the one module that spells the span names,
span attributes and scope must spell them as the page fixes them."""

from __future__ import annotations

from fsdp_patch.telemetry import semconv

from tests.conventions_doc import code_spans, section, table_rows


def test_span_names_are_the_pages_in_the_order_a_step_runs_them():
    names = [code_spans(row[0])[0] for row in table_rows(section("Spans"), "span")]
    want = [semconv.SPAN_STEP, *semconv.STEP_PHASE_SPANS, semconv.SPAN_ZERO_GRAD]
    assert names == want, f"conventions.md spans {names}, semconv {want}"


def test_step_and_zero_grad_attributes_are_the_pages():
    rows = table_rows(section("Span attributes"), "attribute")
    on_span = {name: [code_spans(r[0])[0] for r in rows if name in r[1].split(", ")] for name in ("step", "zero_grad")}
    step_attributes = on_span["step"]
    assert step_attributes == list(semconv.STEP_ATTRIBUTES), (
        f"conventions.md step attributes {step_attributes}, semconv {semconv.STEP_ATTRIBUTES}"
    )
    want_zero_grad = [semconv.ATTR_RANK, semconv.ATTR_ZERO_GRAD_SET_TO_NONE]
    assert on_span["zero_grad"] == want_zero_grad, f"conventions.md {on_span['zero_grad']}, want {want_zero_grad}"
    on_any = [code_spans(r[0])[0] for r in rows if r[1] == "any"]
    assert on_any == [semconv.ATTR_ERROR_TYPE], f"conventions.md {on_any}"


def test_precision_span_attributes_are_the_pages():
    body = section("Span attributes").split("The `fsdp.optimizer.precision` span carries", 1)[1]
    listed = [name for name in code_spans(body) if name.startswith("fsdp.precision.")]
    assert sorted(listed) == sorted(semconv.PRECISION_SPAN_ATTRIBUTES), (
        f"conventions.md {listed}, semconv {semconv.PRECISION_SPAN_ATTRIBUTES}"
    )


def test_scope_and_entry_point_names_are_the_pages():
    conventions = " ".join(section("Instrumentation scope and entry point").split())
    for want in (
        f"name `{semconv.SCOPE_NAME}`",
        f"schema URL `{semconv.SCHEMA_URL}`",
        "entry point `fsdp_patch` in the group `opentelemetry_instrumentor`",
    ):
        assert want in conventions, f"{want!r} not in conventions.md's scope section: {conventions}"
