"""The ReCoVer invariant: every step commits the failure-free global batch (docs/invariant.md).

Owns the quota policies (``[recover.quota]``), the exactly-once ledger of a step's microbatch ids and the step
recovery manager that computes a lost replica's ids in the same step. Pure except the manager, which talks to a
replica sync it is given. May import: ``groups`` (membership helpers), ``registry``.
"""
