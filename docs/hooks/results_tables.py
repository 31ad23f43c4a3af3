"""MkDocs hook: the benchmark tables of the documentation, built from ``benchmarks/results/*.json``.

A page asks for a table with a line of its own::

    <!-- results-table: FILE.json -->

FILE is a file of ``benchmarks/results/``. The line is replaced by a Markdown table of the figures
that file holds, followed by the machine they were measured on and, where the file records it, the
command that produced them (where it does not, the page states the command). The table's form
follows the file's ``benchmark`` field. A file that is missing or unreadable, a benchmark no table
is made for, or a ``results-`` marker of any other form fails the build, naming the file and the
page, so that a figure in the documentation is always one a results file holds: nobody copies
numbers by hand.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!-- results-table: (?P<file>[\w.-]+\.json) -->[ \t]*$", re.M)
# Anything that starts like a marker: a typo in one must fail, not print as an empty comment.
MARKER_LIKE = re.compile(r"^[ \t]*<!--\s*results[-_ ]", re.M)
RESULTS_DIR = Path("benchmarks") / "results"

Document = dict[str, Any]


class ResultsTableError(PluginError):
    """A marker the hook cannot turn into a table; the message names the file."""


def _cell(value: object) -> str:
    # A pipe inside a cell would end it; a newline would end the row.
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ratio(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _params(count: int | None) -> str:
    if not count:
        return ""
    return f"{count / 1e6:.1f}M parameters" if count >= 1e6 else f"{count:,} parameters"


# --- one renderer per benchmark: the table's header and rows, and what the caption adds -----------


def _suite(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks``: every case's rows as the suite prints them."""
    rows = []
    for case in doc["cases"].values():
        for row in case["rows"]:
            unit = row["unit"]
            if unit == "x":
                value = f"{row['value']:.3f}x"
            elif unit == "share":
                value = f"{row['value']:.0%}"
            else:
                value = f"{row['value']:.2f} {unit}"
            met = "" if row["met"] is None else ("yes" if row["met"] else "**no**")
            rows.append([row["case"], row["measure"], value, row["target"] or "-", met, row["note"]])
    header = ["case", "measure", "value", "target", "met", "note"]
    return _table(header, rows), "quick sizes (a smoke run)" if doc.get("quick") else ""


def _origin_checks(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.origin_checks``: the per-iteration checks on against off, per sharding."""
    calls = any("calls_per_step" in doc.get(k, {}) for k in ("fully_shard", "fsdp2"))
    header = ["sharding", "step, checks off", "step, checks on", "checks / off (each build order)"]
    header += ["escalated / off", "checks' own time", "operators per step"] + (
        ["Python calls per step"] if calls else []
    )
    rows = []
    for key, name in (("fully_shard", "`fully_shard`"), ("fsdp2", "torch FSDP2")):
        if key not in doc:
            continue
        r = doc[key]
        orders = ", ".join(_ratio(v) for v in r.get("ratio_checks_off_by_order", []))
        own = "-" if "own_s" not in r else f"{_ms(r['own_s'])}, {r['own_share']:.1%} of a step"
        row = [name, _ms(r["step_s_off"]), _ms(r["step_s_checks"]), f"{_ratio(r['ratio_checks_off'])} ({orders})"]
        row += [_ratio(r.get("ratio_escalated_off")), own, _count(r.get("ops_per_step"))]
        rows.append(row + ([_count(r.get("calls_per_step"))] if calls else []))
    notes = [_params(doc.get("params")), f"{doc['steps']} steps"]
    if doc.get("host_bound"):
        notes.append("host-bound model (width 16)")
    return _table(header, rows), ", ".join(n for n in notes if n)


def _op_audit_cost(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.op_audit_cost``: an audited, a shadowed and a both step against a plain one."""
    every = doc.get("every", 1000)
    header = ["sharding", "plain step", "audited / plain", "shadowed / plain", "both / plain"]
    header.append(f"a run at one in {every}")
    rows = []
    for key, name in (("fully_shard", "`fully_shard`"), ("fsdp2", "torch FSDP2")):
        if key not in doc:
            continue
        r = doc[key]
        rows.append(
            [
                name,
                _ms(r["step_s_plain"]),
                _ratio(r.get("ratio_audited_plain"), 2),
                _ratio(r.get("ratio_shadowed_plain"), 2),
                _ratio(r.get("ratio_both_plain"), 2),
                _ratio(r.get("amortized_at_default"), 4),
            ]
        )
    return _table(header, rows), ", ".join(n for n in (_params(doc.get("params")), f"{doc['steps']} steps") if n)


def _telemetry_overhead(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.telemetry_overhead``: case 5's settings run alone, training step and optimizer step."""
    large = doc["large"]
    settings = (
        ("off", "telemetry off"),
        ("on", "telemetry on, diagnostics off"),
        ("diagnostics", "whole-model diagnostics every step"),
        ("attribution", "diagnostics with the attribution every step"),
    )
    rows = []
    for key, name in settings:
        if f"step_s_{key}" not in large:
            continue
        ratio = None if key == "off" else large.get(f"ratio_{key}_off")
        opt_ratio = None if key == "off" else large.get(f"optimizer_step_ratio_{key}_off")
        rows.append(
            [
                name,
                _ms(large[f"step_s_{key}"]),
                _ratio(ratio),
                _ms(large.get(f"optimizer_step_s_{key}")),
                _ratio(opt_ratio),
            ]
        )
    header = ["setting", "training step", "/ off", "`optimizer.step()`", "/ off"]
    notes = [_params(large.get("params")), f"{large['steps']} steps"]
    if "ratio_attribution_diagnostics" in large:
        notes.append(f"attribution / whole-model diagnostics {_ratio(large['ratio_attribution_diagnostics'])}")
    tiny = doc.get("tiny")
    if tiny and "fixed_cost_s" in tiny:
        notes.append(
            f"fixed cost of a traced step (a model of {_params(tiny.get('params'))}) {tiny['fixed_cost_s'] * 1e6:.0f} us"
        )
    return _table(header, rows), "; ".join(n for n in notes if n)


def _determinism_soak(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.determinism_soak``: per topology, the runs and how many final states they reached."""
    first = doc["results"][0]["digests"] if doc["results"] else None
    rows = []
    for nodes in doc["nodes"]:
        runs = [r for r in doc["results"] if r["nodes"] == nodes]
        states = {tuple(r["digests"]) for r in runs}
        differ = sum(r["digests"] != first for r in runs)
        settings = sorted({r["setting"] for r in runs})
        rows.append(
            [
                str(doc["world_size"]),
                str(nodes),
                f"{len(runs)} ({', '.join(settings)})",
                f"{doc['steps']} x {doc['microbatches']}",
                str(len(states)),
                str(differ),
            ]
        )
    header = ["ranks", "nodes", "runs", "steps x microbatches", "distinct final states", "runs unlike the first"]
    summary = doc["summary"]
    note = f"{doc['jobs']} jobs of {doc['runs_per_setting_and_job']} runs per setting; all runs: {summary['runs']}, "
    note += f"distinct final states {summary['distinct_states']}"
    return _table(header, rows), note


def _bug_patterns(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.bug_patterns``: per pattern, the diagnosis wanted and whether each sharding's report named it."""
    by_pattern: dict[str, dict[str, list[bool]]] = {}
    for run in doc["runs"]:
        by_pattern.setdefault(run["pattern"], {}).setdefault(run["kind"], []).append(run["judgement"]["named"])

    def named(results: list[bool] | None) -> str:
        if not results:
            return "-"
        if all(results):
            return "yes" if len(results) == 1 else f"yes ({len(results)} schedules)"
        return f"**no** ({results.count(False)} of {len(results)} schedules)"

    rows = []
    for key, pattern in doc["patterns"].items():
        expect = pattern["expect"]
        wanted = expect.get("cause") or expect.get("finding") or expect.get("verdict", "")
        kinds = by_pattern.get(key, {})
        rows.append(
            [pattern["number"], pattern["title"], wanted, named(kinds.get("fully_shard")), named(kinds.get("fsdp2"))]
        )
    runs = doc["runs"]
    note = f"the cause named in {sum(r['judgement']['named'] for r in runs)} of {len(runs)} runs"
    header = [
        "#",
        "pattern",
        "what a correct report names",
        "`fully_shard`'s report names it",
        "FSDP2's report names it",
    ]
    return _table(header, rows), note


def _host_cost(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.host_cost``: telemetry's host cost per undiagnosed step by model size."""
    sizes = [size for key in ("fully_shard", "fsdp2") if key in doc for size in doc[key]["sizes"]]
    syncs = any("syncs_on" in size for size in sizes)  # a GPU's run: its profiled synchronizations
    header = ["sharding", "tensors", "step, off", "on / off", "added", "diagnosed / off"]
    header += ["CUDA syncs on / off"] if syncs else []
    rows = []
    for key, name in (("fully_shard", "`fully_shard`"), ("fsdp2", "torch FSDP2")):
        if key not in doc:
            continue
        for size in doc[key]["sizes"]:
            count = size.get("params", 0)
            params = f" ({count / 1e9:.2f}B parameters)" if count >= 1e9 else ""
            params = params or (f" ({count / 1e6:.1f}M parameters)" if count >= 1e6 else "")
            row = [
                name,
                f"{size['tensors']}{params}",
                _ms(size["step_s_off"]),
                _ratio(size["ratio_on_off"]),
                f"{size['added_s'] * 1e6:.0f} us",
                _ratio(size["ratio_diagnosed_off"]),
            ]
            rows.append(row + ([f"{size.get('syncs_on', '-')} / {size.get('syncs_off', '-')}"] if syncs else []))
        fit = doc[key]
        if len(doc[key]["sizes"]) > 1:
            added = f"{fit['added_fixed_s'] * 1e6:.0f} us + {fit['added_per_tensor_s'] * 1e6:.2f} us per tensor"
            rows.append([name, "fit", "", "", added, ""] + ([""] if syncs else []))
    dtype = doc.get("compute_dtype", "default")
    compute = "" if dtype == "default" else f", {dtype.removeprefix('torch.')} compute"
    clipped = f", grads clipped to a total norm of {doc['clip']:g} every step" if doc.get("clip") else ""
    note = f"width {doc.get('width', 16)}{compute}{clipped}, {doc['rounds']} paired steps per size"
    return _table(header, rows), note


def _float8_gather(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.float8_gather``: the float8 compute copy against the bf16 one."""
    header = ["compute copy", "gathered per step", "all-gathers", "live before the step", "peak", "step"]
    rows = []
    for key, name in (("bf16", "bf16"), ("float8", "float8 (torchao tensorwise)")):
        r = doc[key]
        rows.append(
            [
                name,
                f"{r['gathered_bytes'] / 2**20:.2f} MiB",
                str(r["gathers"]),
                f"{r['live_bytes'] / 2**20:.1f} MiB",
                f"{r['peak_bytes'] / 2**20:.1f} MiB",
                _ms(r["step_s"]),
            ]
        )
    rows.append(
        [
            "float8 / bf16",
            _ratio(doc["ratio_gathered"]),
            "",
            _ratio(doc["float8"]["live_bytes"] / doc["bf16"]["live_bytes"]),
            _ratio(doc["ratio_peak"]),
            _ratio(doc["ratio_step"]),
        ]
    )
    if "fsdp2_float8" in doc:
        r = doc["fsdp2_float8"]
        rows.append(
            [
                "FSDP2, torchao's float8 all-gather",
                f"{r['gathered_bytes'] / 2**20:.2f} MiB",
                str(r["gathers"]),
                f"{r['live_bytes'] / 2**20:.1f} MiB",
                f"{r['peak_bytes'] / 2**20:.1f} MiB",
                _ms(r["step_s"]),
            ]
        )
        rows.append(["float8 / FSDP2's float8", "", "", "", "", _ratio(doc["ratio_step_against_fsdp2"])])
    note = f"{doc['layers']} layers of width {doc['width']}, {_params(doc.get('params'))}, {doc['steps']} paired steps"
    return _table(header, rows), note


def _span_cost(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.span_cost``: a step's spans recorded in plain Python against the SDK's."""
    header = ["sharding", "step, off", "added, spans recorded", "added, the SDK's spans", "recording saves"]
    rows = []
    for key, name in (("fully_shard", "`fully_shard`"), ("fsdp2", "torch FSDP2")):
        got = doc[key]
        added = [f"{got[field] * 1e6:.0f} us" for field in ("added_s_recorded", "added_s_sdk", "saved_s")]
        rows.append([name, _ms(got["step_s_off"]), *added])
    first = doc["fully_shard"]
    note = f"{first['tensors']} parameter tensors at width {doc['width']}, {first['rounds']} paired rounds"
    return _table(header, rows), note


def _float8_watch_cost(doc: Document) -> tuple[str, str]:
    """``python -m benchmarks.float8_watch_cost``: the float8 cast watch's cost."""
    header = ["", "step", "against off"]
    rows = [
        ["telemetry off", _ms(doc["step_s_off"]), ""],
        ["at the defaults, undiagnosed steps", _ms(doc["step_s_on"]), _ratio(doc["ratio_on_off"])],
        [
            "diagnosed, the watch off",
            _ms(doc["step_s_diagnosed_no_watch"]),
            _ratio(doc["ratio_diagnosed_no_watch_off"]),
        ],
        ["diagnosed, the watch on", _ms(doc["step_s_diagnosed"]), _ratio(doc["ratio_diagnosed_off"])],
        [
            "the watch, spread over the default interval (100 steps)",
            _ms(doc["watch_s_per_diagnosed_step"]) + " a diagnosed step",
            f"{doc['ratio_default_interval']:.4f}x",
        ],
    ]
    note = f"{doc['layers']} Float8Linear layers of width {doc['width']}, {doc['rounds']} paired rounds"
    return _table(header, rows), note


RENDERERS: dict[str, Callable[[Document], tuple[str, str]]] = {
    "float8_gather": _float8_gather,
    "float8_watch_cost": _float8_watch_cost,
    "host_cost": _host_cost,
    "span_cost": _span_cost,
    "suite": _suite,
    "origin_checks": _origin_checks,
    "op_audit_cost": _op_audit_cost,
    "telemetry_overhead": _telemetry_overhead,
    "determinism_soak": _determinism_soak,
    "bug_patterns": _bug_patterns,
}


def _machine(doc: Document) -> str:
    parts = [f"`{doc.get('device', 'unknown device')}`"]
    machine = doc.get("machine") or {}
    if machine:
        described = [machine.get("platform"), machine.get("processor") or None]
        if machine.get("cpus"):
            described.append(f"{machine['cpus']} CPUs")
        parts.append("(" + ", ".join(str(d) for d in described if d) + ")")
    facts = [
        f"torch {doc['torch']}" if "torch" in doc else None,
        f"Python {doc['python']}" if "python" in doc else None,
    ]
    if "world_size" in doc:
        facts.append(f"{doc['world_size']} rank{'s' if doc['world_size'] != 1 else ''}")
    if "timer" in doc:
        facts.append(f"timer {doc['timer']}")
    if "time" in doc:
        facts.append(str(doc["time"])[:10])
    return " ".join(parts) + ", " + ", ".join(f for f in facts if f)


def _command(doc: Document) -> str | None:
    command = doc.get("command") or doc.get("argv")
    if isinstance(command, list):
        command = " ".join(str(c) for c in command)
    return command or None


def render(name: str, results_dir: Path) -> str:
    """The table a marker naming ``name`` stands for, with its caption; raises naming the file otherwise."""
    path = results_dir / name
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsTableError(f"results table: {RESULTS_DIR / name} does not exist") from None
    except (OSError, ValueError) as e:
        raise ResultsTableError(f"results table: {RESULTS_DIR / name} cannot be read as JSON: {e}") from e
    benchmark = doc.get("benchmark") if isinstance(doc, dict) else None
    renderer = RENDERERS.get(str(benchmark))
    if renderer is None:
        raise ResultsTableError(
            f"results table: {RESULTS_DIR / name} holds benchmark {benchmark!r}, for which no table is made "
            f"(known: {', '.join(sorted(RENDERERS))})"
        )
    try:
        table, note = renderer(doc)
    except (KeyError, TypeError, IndexError) as e:
        raise ResultsTableError(
            f"results table: {RESULTS_DIR / name} lacks what a {benchmark} table needs: {e!r}"
        ) from e
    caption = f"Measured on {_machine(doc)}" + (f"; {note}" if note else "") + f". Source: `{RESULTS_DIR / name}`"
    command = _command(doc)
    if command:
        caption += f"; command: `{command}`"
    return f"{table}\n\n*{caption}.*"


def render_markers(markdown: str, results_dir: Path, page: str = "a page") -> str:
    """``markdown`` with every results-table marker replaced by its table."""
    for line in markdown.splitlines():
        if MARKER_LIKE.match(line) and not MARKER.match(line):
            raise ResultsTableError(
                f"results table: {page} has a marker this hook does not read: {line.strip()!r} "
                "(expected '<!-- results-table: FILE.json -->' on a line of its own)"
            )
    try:
        return MARKER.sub(lambda m: render(m.group("file"), results_dir), markdown)
    except ResultsTableError as e:
        raise ResultsTableError(f"{e} (asked for by {page})") from None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root = Path(config.config_file_path).resolve().parent
    return render_markers(markdown, root / RESULTS_DIR, page.file.src_uri)
