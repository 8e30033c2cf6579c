"""PHOENIX: capacity comes back from peers' memory (docs/phoenix.md).

Owns the training state's streaming between replicas (chunked, checksummed) and in-memory snapshots of a job
without replicas (``[recover.snapshot]``): the keeper process (``keeper.py``) and the ranks' take and restore
(``snapshots.py``; the restore is called by the project's checkpoint manager, ``titan_recover/checkpoint.py``).
May import: ``groups.blobs``, ``events``, ``servers``.
"""
