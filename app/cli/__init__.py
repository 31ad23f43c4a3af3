"""The ``fsdp-patch`` command (also ``python -m fsdp_patch``).

Subcommands::

    fsdp-patch demo [options]                    the main job (see fsdp-patch demo --help)
    fsdp-patch report TRACE_DIR [--lines N] [--json]  precision verdicts from a run's trace files
    fsdp-patch trace merge OUTPUT INPUT...       per-rank Chrome traces into one Perfetto file
    fsdp-patch trace jaeger OUTPUT INPUT...      Chrome traces into one Jaeger upload file

An INPUT is a trace file or a trace directory (its rotated segments included). Bad input gives
one line on stderr, ``fsdp-patch <subcommand>: <what was wrong>``, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .parser import UsageError, build_parser

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def _demo(args: argparse.Namespace) -> int:
    from ..demo.run import main as demo_main

    return demo_main(args)


def _report(args: argparse.Namespace) -> int:
    from fsdp_patch.telemetry.offline.precision_report import report, report_json

    if args.lines < 1:
        raise UsageError(f"fsdp-patch report: --lines {args.lines} is too small; expected an integer >= 1")
    if args.html is not None:
        _write_html(args.trace_dir, args.lines, args.html)
    if args.json:
        import json

        sys.stdout.write(json.dumps(report_json(args.trace_dir, args.lines), indent=1) + "\n")
        return 0
    sys.stdout.write(report(args.trace_dir, args.lines))
    return 0


def _write_html(trace_dir: str, lines: int, out: str) -> None:
    from fsdp_patch.telemetry.offline.html_report import HtmlOutputError, write_report_html

    try:
        write_report_html(trace_dir, out, lines)
    except HtmlOutputError as exc:
        raise UsageError(f"fsdp-patch report: --html {exc}") from None
    print(f"html report: {out}", file=sys.stderr)


def _trace(args: argparse.Namespace) -> int:
    from fsdp_patch.telemetry.offline.trace_conversion import merge_chrome_traces, write_jaeger

    if args.trace_command == "merge":
        print(f"wrote {merge_chrome_traces(args.inputs, args.output)} events to {args.output}")
    else:
        result = write_jaeger(args.inputs, args.output)
        print(f"wrote {result.traces} traces to {args.output}")
    return 0


_HANDLERS = {"demo": _demo, "report": _report, "trace": _trace}


def _prog(args: argparse.Namespace | None) -> str:
    """The command as the user typed it, down to the trace tool (``fsdp-patch trace merge``)."""
    words = ["fsdp-patch", getattr(args, "command", None), getattr(args, "trace_command", None)]
    return " ".join(w for w in words if w)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for bad input, with one line on stderr)."""
    from fsdp_patch.telemetry.offline.trace_reading import TraceFileError

    from ..demo.options import DemoInputError

    parser = build_parser()
    args: argparse.Namespace | None = None
    try:
        args = parser.parse_args(argv)
        return _HANDLERS[args.command](args)
    except UsageError as exc:
        print(str(exc).replace("\n", " "), file=sys.stderr)
        return EXIT_USAGE
    except (DemoInputError, TraceFileError, OSError) as exc:  # OSError: an input or output the user named
        print(f"{_prog(args)}: {exc}".replace("\n", " "), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("fsdp-patch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
