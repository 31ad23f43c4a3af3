"""The benchmark suite (``python -m benchmarks``, see :mod:`benchmarks.suite`) and its cases."""
