"""The syncer's progress and metrics (docs/diloco.md, "End of the job and metrics"): tokens merged, goodput,
one record per merge or evaluation in ``syncer_metrics.jsonl``, which node 0's launcher logs to the job's wandb run
(``recover/job_log.py``)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """What the merges achieved; part of the checkpoint."""

    merges: int = 0
    merged_tokens: float = 0
    merged_step: dict[int, dict[int, int]] = field(default_factory=dict)  # learner -> fragment -> inner step
    started_at: float = field(default_factory=time.time)

    def record_merge(self, fragment: int, fragments: int, tokens: dict[int, int], steps: dict[int, int]) -> None:
        # a token is in the global model once every fragment merged its progress: each fragment's merge counts
        # its share of the parameters (fragments are near-equal in size)
        self.merges += 1
        self.merged_tokens += sum(tokens.values()) / fragments
        for learner, step in steps.items():
            merged = self.merged_step.setdefault(learner, {})
            merged[fragment] = max(merged.get(fragment, 0), step)

    def goodput(self, now: float) -> float:
        return self.merged_tokens / max(now - self.started_at, 1e-9)

    def state_dict(self) -> dict:
        return {"merges": self.merges, "merged_tokens": self.merged_tokens, "merged_step": self.merged_step,
                "started_at": self.started_at}

    def load_state_dict(self, state: dict) -> None:
        self.merges, self.merged_tokens = state["merges"], state["merged_tokens"]
        self.merged_step = {int(k): {int(f): s for f, s in v.items()} for k, v in state["merged_step"].items()}
        self.started_at = state["started_at"]


class SyncerMetrics:
    """``syncer_metrics.jsonl`` (step: merges so far); the job's wandb run shows it as ``syncer/*``."""

    def __init__(self, run_dir: str):
        from titan_recover.metrics import JsonlLogger  # imports TorchTitan: after the platform is active

        self.jsonl = JsonlLogger(os.path.join(run_dir, "syncer_metrics.jsonl"))

    def log(self, now: float, progress: Progress, alive: int, merge: dict | None = None,
            val_loss: float | None = None) -> None:
        record = {"elapsed_s": now - progress.started_at, "merges": progress.merges,
                  "merged_tokens": progress.merged_tokens, "goodput_tokens_per_s": progress.goodput(now),
                  "alive": alive}
        if merge is not None:
            staleness = [s for s in merge["staleness"].values() if s is not None]
            record.update({"fragment": merge["fragment"], "version": merge["version"],
                           "quorum_size": len(merge["learners"]), "window_s": merge["window_s"],
                           "staleness_mean": sum(staleness) / len(staleness) if staleness else None})
        if val_loss is not None:
            record["val_loss"] = val_loss
        self.jsonl.log(record, step=progress.merges)

    def close(self) -> None:
        pass
