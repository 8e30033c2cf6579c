"""The ReCoVer invariant: every step commits the failure-free global batch (docs/invariant.md).

Owns the quota policies (``[recover.quota]``), the exactly-once ledger of a step's microbatch ids, the step
recovery manager that computes a lost replica's ids in the same step, and the gradient clip every replica computes
alike. Pure except the manager, which talks to a replica sync it is given, and the clip, which all-gathers inside
the replica. May import: ``groups`` (membership helpers), ``registry``.
"""
