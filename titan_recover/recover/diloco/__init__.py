"""Decoupled DiLoCo: learners that never wait for each other, and the syncer that merges them (docs/diloco.md).

Owns the pure rules (fragments, quorum, grace window, token-weighted merge, outer optimizer, data blocks), the
learner's transport and the syncer process (``[recover.diloco]``). May import: ``groups`` (membership, blobs),
``phoenix.state_transfer`` (byte views), ``events``.
"""
