"""The container format: one file of records plus an offset index, or a folder of shards.

Knows nothing of VOC, torch or URLs. ``spec`` is the specification (see docs/FORMAT.md).
"""
