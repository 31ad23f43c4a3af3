"""The precision diagnostics: statistics of the flat buffers (``fully_shard``) and sharded tensors
(FSDP2) around an optimizer step, per parameter, and the findings attributed to parameters.

torch, no OpenTelemetry: the instrumentation records what these compute.
"""
