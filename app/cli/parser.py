"""The argument parser of ``fsdp-patch``, whose errors are one line."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(ValueError):
    """Bad command-line input; the message is the whole line to print."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage and the message, then exits; the contract is one line and exit 2.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """``fsdp-patch`` with its subcommands ``demo``, ``report`` and ``trace merge|jaeger``."""
    from ..demo.options import add_arguments

    parser = _Parser(prog="fsdp-patch", description="fsdp_patch: the demo, precision reports and trace-file tools.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="{demo,report,trace}")
    demo = commands.add_parser(
        "demo",
        help="train the small transformer with telemetry, checkpoints and a precision report",
        description="The main job: mixed-precision FSDP training on 2 CPU ranks (or torchrun's) with telemetry.",
    )
    add_arguments(demo)
    report = commands.add_parser(
        "report", help="precision verdicts per step range from a run's trace files", description="Precision report."
    )
    report.add_argument("trace_dir", metavar="TRACE_DIR", help="directory of rank*.trace.json files")
    report.add_argument("--lines", type=int, default=10, help="most step ranges (default 10)")
    report.add_argument("--json", action="store_true", help="the same report as JSON, for machines")
    report.add_argument(
        "--html",
        metavar="OUT.html",
        help="also write the report as one self-contained HTML page of per-step plots (opens in any browser, offline)",
    )
    trace = commands.add_parser(
        "trace", help="merge trace files, or convert them for Jaeger", description="Trace-file tools."
    )
    tools = trace.add_subparsers(dest="trace_command", required=True, parser_class=_Parser, metavar="{merge,jaeger}")
    for name, text in (
        ("merge", "per-rank Chrome traces into one file for Perfetto (a row per rank)"),
        ("jaeger", "Chrome traces into one Jaeger query-API JSON file (Jaeger UI: Search > JSON File)"),
    ):
        tool = tools.add_parser(name, help=text, description=text)
        tool.add_argument("output", metavar="OUTPUT")
        tool.add_argument("inputs", metavar="INPUT", nargs="+", help="trace files or trace directories")
    return parser
