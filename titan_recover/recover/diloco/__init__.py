"""Decoupled DiLoCo: learners that never wait for each other, and the syncer that merges them (docs/diloco.md).

Owns the pure rules (``rules``: fragments, quorum, grace window, token-weighted merge, outer optimizer, store keys),
the data-block protocol in the coordinator's store (``blocks``), the messages in the syncer's store (``messages``),
a learner rank (``learner``, ``fragments``, ``transport``) and the syncer process (``syncer/``), configured by
``[recover.diloco]``. May import: ``groups`` (membership, liveness, blobs), ``stores`` (the job's store by URL),
``phoenix.state_transfer`` (byte views), ``events``; ``chaos`` only where faults are injected (the syncer's own faults).
TorchTitan-loading code (``titan_recover.job_config``, ``titan_recover.evaluate``, ``titan_recover.metrics``) is
imported lazily: the run's config is built only in the syncer's process entry (``syncer/__main__.py``).
"""
