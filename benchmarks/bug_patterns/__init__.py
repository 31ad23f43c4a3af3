"""Mixed-precision bug patterns from public issue trackers, planted in a tiny model on 2 gloo ranks
under ``fully_shard`` and torch FSDP2, and what the precision report says about each.

- :mod:`.catalogue`: the patterns and healthy controls, their sources, settings and expected diagnosis;
- :mod:`.plants`: the code that plants each bug;
- :mod:`.training`: the tiny model and the training loop with its planting hooks;
- :mod:`.run`: ``python -m benchmarks.bug_patterns``, every pattern under both shardings, as a table.
"""
