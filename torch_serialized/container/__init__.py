"""The container format: one file of records plus an offset index, or a folder of shards.

``spec`` is the specification (docs/FORMAT.md in code), ``manifest`` a shard folder's manifest
and which pack a file belongs to. Write side: ``writer`` (one container), ``shardwriter`` (a
pack), ``append``, ``parallel``. Read side, never imported by the write side: ``reader`` (one
container), ``shards`` (a pack), ``locate``. ``fileio``: opens, atomic output and reads.
Knows nothing of VOC or torch.
"""
