"""PHOENIX: capacity comes back from peers' memory (docs/phoenix.md).

Owns the training state's streaming between replicas (chunked, checksummed) and in-memory snapshots of a job
without replicas (``[recover.snapshot]``: keeper process, take, restore). May import: ``groups.blobs``, ``events``.
"""
