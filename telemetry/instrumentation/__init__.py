"""The instrumentation: the instrumentor (``opentelemetry-instrument``'s entry point), the observer
that turns the adapter's step events into spans and metrics, the instrument table, step timing,
and the observer source the adapter asks.

The top layer: imports diagnostics, export and the names below.
"""
