"""The code against docs/conventions.md, both ways: every name the product spells (semconv's
constants, the instrument table, the FSDP_PATCH_* variables it reads, the resource attributes, the
command line, the public API) is on the page, and the page's tables are what the code emits.
A name added to the code without a line on the page fails here."""

from __future__ import annotations

import argparse
import inspect
import re
from importlib import metadata

from fsdp_patch.telemetry import env, semconv, trace_limits
from fsdp_patch.telemetry.instrumentation import instruments

from tests.conventions_doc import REPO, code_spans, conventions_text, section, table_rows

# Where the product's code lives: every FSDP_PATCH_* variable spelled there is a setting users set.
PRODUCT_SOURCES = ("fsdp_patch", "telemetry")
VARIABLE = re.compile(r"\bFSDP_PATCH_[A-Z][A-Z0-9_]*[A-Z0-9]\b")


def _semconv_names() -> dict[str, str]:
    return {k: v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)}


def test_every_name_semconv_spells_is_on_the_page():
    text = conventions_text()
    missing = {k: v for k, v in _semconv_names().items() if f"`{v}`" not in text}
    assert not missing, f"semconv names not in docs/conventions.md: {missing}"


def test_metric_table_is_the_instrument_table():
    rows = table_rows(section("Metrics"), "name")
    page = {}
    for name, kind, unit, attrs in rows:
        keys = re.findall(r"`(fsdp\.[\w.]+)`(?: \(([^)]*)\))?", attrs)
        page[code_spans(name)[0]] = (kind, code_spans(unit)[0], {k: tuple(code_spans(v)) for k, v in keys})
    enumerated = {
        semconv.ATTR_CAST_KIND: semconv.CAST_KINDS,
        semconv.ATTR_MISMATCH_ACTION: semconv.MISMATCH_ACTIONS,
        semconv.ATTR_TENSOR: semconv.TENSORS,
        semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_KINDS,
    }
    # An attribute whose values differ for one instrument: the audit also names optimizer state.
    per_instrument = {(semconv.METRIC_DTYPE_CONTRACT, semconv.ATTR_TENSOR): semconv.CONTRACT_TENSORS}
    code = {
        spec.name: (
            spec.kind,
            spec.unit,
            {a: tuple(per_instrument.get((spec.name, a), enumerated.get(a, ()))) for a in spec.attributes},
        )
        for spec in instruments.INSTRUMENTS
    }
    only_code = sorted(set(code) - set(page))
    only_page = sorted(set(page) - set(code))
    assert not only_code and not only_page, (
        f"instruments not on docs/conventions.md: {only_code}; on the page but not created: {only_page}"
    )
    differ = {name: {"page": page[name], "code": code[name]} for name in code if page[name] != code[name]}
    assert not differ, f"kind, unit or attributes differ: {differ}"


def test_every_instrument_has_its_prometheus_name_on_the_page():
    rows = table_rows(section("Metrics"), "instrument")
    listed = [code_spans(r[0])[0] for r in rows]
    want = [spec.name for spec in instruments.INSTRUMENTS]
    assert listed == want, f"Prometheus table lists {listed}, the instrument table is {want}"


def test_resource_attributes_are_the_pages():
    from fsdp_patch.telemetry.export.ranks import RankInfo
    from fsdp_patch.telemetry.export.resource import rank_attributes

    listed = {code_spans(r[0])[0] for r in table_rows(section("Resource attributes"), "attribute")}
    emitted = set(
        rank_attributes(RankInfo(rank=1, world_size=2, local_rank=1, run_id="job-7", mesh_coordinate="dp=0,tp=1"))
    )
    assert listed == emitted, f"conventions.md resource attributes {sorted(listed)}, emitted {sorted(emitted)}"


def _variables_in_product() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in PRODUCT_SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for name in VARIABLE.findall(path.read_text(encoding="utf-8")):
                found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def test_every_fsdp_patch_variable_the_product_reads_is_on_the_page():
    table = {code_spans(r[0])[0] for r in table_rows(section("`FSDP_PATCH_*`"), "variable")}
    in_code = _variables_in_product()
    only_code = {name: sorted(set(files)) for name, files in in_code.items() if name not in table}
    assert not only_code, f"variables read by the product but not on docs/conventions.md: {only_code}"
    only_page = sorted(table - set(in_code))
    assert not only_page, f"variables on docs/conventions.md that no product code reads: {only_page}"


def test_variable_defaults_on_the_page_are_the_parsers():
    defaults = {code_spans(r[0])[0]: r[1] for r in table_rows(section("`FSDP_PATCH_*`"), "variable")}
    # The page's default, given back to the parser, reads as the variable left unset.
    parsers = {
        env.PRECISION_EVERY: env.precision_every,
        env.TRACE_RANKS: env.trace_ranks,
        env.TRACE_DIR: env.trace_dir,
        env.SUMMARY: env.summary_mode,
        env.FLUSH_TIMEOUT: env.flush_timeout_s,
        trace_limits.TRACE_MAX_BYTES: trace_limits.trace_max_bytes,
        semconv.SETTING_PRECISION_TOP_K: env.precision_top_k,
        semconv.SETTING_PRECISION_WINDOW: env.precision_window,
        semconv.SETTING_PRECISION_DETAIL: env.precision_detail,
    }
    for name, parse in parsers.items():
        written = code_spans(defaults[name])
        assert len(written) == 1, f"{name}: the page's default {defaults[name]!r} is not one `value`"
        got, want = parse({name: written[0]}), parse({})
        assert got == want, f"{name}: the page's default {written[0]!r} parses as {got!r}, unset gives {want!r}"
    assert defaults[env.TELEMETRY] == "off" and env.telemetry_enabled({}) is False
    assert defaults[env.COMPUTE_DTYPE] == "unset" and env.compute_dtype({}) is None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def test_command_line_is_the_pages():
    from fsdp_patch.app.cli.parser import build_parser

    listed = [code_spans(r[0])[0].split() for r in table_rows(section("Command line"), "command")]
    commands = {words[1] for words in listed}
    top = _subcommands(build_parser())
    assert commands == set(top), f"conventions.md commands {sorted(commands)}, fsdp-patch has {sorted(top)}"
    trace_tools = {words[2] for words in listed if words[1] == "trace"}
    assert trace_tools == set(_subcommands(top["trace"])), f"trace tools {sorted(trace_tools)}"
    report_options = {w.strip("[]") for words in listed if words[1] == "report" for w in words if w.startswith("[--")}
    have = {opt for action in top["report"]._actions for opt in action.option_strings}
    assert report_options <= have, f"report options on the page {report_options}, the parser has {have}"
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts") if ep.name == "fsdp-patch"}
    assert scripts == {"fsdp-patch": "fsdp_patch.app.cli:main"}, f"installed command: {scripts}"


def test_instrumentor_entry_point_is_installed_as_the_page_says():
    points = {ep.name: ep.value for ep in metadata.entry_points(group="opentelemetry_instrumentor")}
    assert points.get("fsdp_patch") == "fsdp_patch.telemetry.instrumentation.instrumentor:FSDPOptimizerInstrumentor", (
        points
    )
    from fsdp_patch.telemetry import FSDPOptimizerInstrumentor

    assert "`fsdp_patch.telemetry.FSDPOptimizerInstrumentor`" in section("Instrumentation scope and entry point")
    assert FSDPOptimizerInstrumentor.__module__.startswith("fsdp_patch.telemetry")


def test_public_api_is_the_pages():
    import fsdp_patch.optimizer as optimizer

    body = " ".join(section("Public API").split())
    assert f"`fsdp_patch.optimizer.__all__ == {optimizer.__all__!r}`".replace("'", '"') in body, optimizer.__all__
    for fn in (optimizer.fully_shard_optimizer, optimizer.init_optimizer_state):
        written = f"`{fn.__name__}{_plain_signature(fn)}`"
        assert written in body, f"{written} is not on the page's Public API section"


def _plain_signature(fn) -> str:
    """``(optimizer, *, precision_aware=False) -> None``: names, keyword-only marker, defaults, return."""
    parts: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind is param.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        parts.append(param.name if param.default is param.empty else f"{param.name}={param.default!r}")
    returns = inspect.signature(fn).return_annotation
    return f"({', '.join(parts)}) -> {returns if isinstance(returns, str) else returns.__name__}"
