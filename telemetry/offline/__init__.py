"""Offline tools over the trace files a run wrote: reading them back, converting them (merge, Jaeger),
the precision and attribution reports.

No OpenTelemetry and no torch here (``fsdp-patch report``/``trace`` run where neither is installed);
imports only the names and settings below it.
"""
