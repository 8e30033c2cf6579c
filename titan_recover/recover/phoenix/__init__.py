"""PHOENIX: capacity comes back from peers' memory (docs/phoenix.md).

Owns the training state's streaming between replicas (chunked, checksummed, through a ring of host buffers) and
in-memory snapshots of a job without replicas (``[recover.snapshot]``): the keeper process (``keeper.py``) and the
ranks' take and restore (``snapshots.py``; the restore is called by the project's checkpoint manager,
``titan_recover/checkpoint.py``); both stage device tensors through host memory with ``staging.py``.
May import: ``groups.blobs``, ``events``, ``servers``.
"""
