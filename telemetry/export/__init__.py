"""The embedded default: the SDK providers this package builds when the application installed
none, their exporters (the trace files, the summary, OTLP, Prometheus), isolation and shutdown.

The OpenTelemetry SDK lives here; imports the offline trace reading and conversion and the names and settings below it.
"""
