"""The demo (the project's main job): mixed-precision FSDP training with telemetry, on one machine.

``fsdp-patch demo`` trains a small transformer on 2 CPU gloo ranks (or the ranks torchrun
started, on NCCL when CUDA is there) with bf16 compute weights, fp32 main weights and bf16
main grads through ``fully_shard`` and ``fully_shard_optimizer``, AdamW with warm-up and
cosine decay, telemetry on its embedded default; it checkpoints with DCP, resumes bitwise, and
ends with the precision report of its trace files. ``--scenario`` plants a numeric bug for the
report to find. See :mod:`fsdp_patch.app.demo.options` for every option and
:mod:`fsdp_patch.app.demo.scenarios` for the bugs.
"""
