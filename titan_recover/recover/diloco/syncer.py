"""The diloco syncer: global parameters, the outer optimizer, and the merges (docs/diloco.md).

    python -m titan_recover.recover.diloco.syncer --coordinator HOST:PORT --run-dir DIR --positions W [--start N]
        [CONFIG.toml] [--section.key value ...]

One process per job, started (and restarted after a crash) by the launcher. It hosts its own store, publishes its
address and generation through the coordinator's store, takes the first complete parameter offer of a learner as
the initial global model (or resumes from its checkpoint), and then loops: read the learners' deltas, close every
fragment's round once its quorum delivered and the grace window says so, merge with token weights, step the outer
optimizer, publish the new version. It never waits for a learner it does not expect (dead, or not worth it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from titan_recover.recover.groups.blobs import delete_blob, get_blob, put_blob
from titan_recover.recover.diloco.rules import (
    DilocoKeys,
    encode_versions,
    GraceDecision,
    grace_window,
    merge_deltas,
    OuterOptimizer,
    token_weights,
    total_blocks,
    Version,
)
from titan_recover.recover.events import EventLog
from titan_recover.recover.diloco.learner import requeue_block
from titan_recover.recover.groups.member import connect
from titan_recover.recover.groups.keys import GroupKeys as Keys
from titan_recover.recover.groups.protocol import Heartbeat, LivenessWatch
from titan_recover.recover.phoenix.state_transfer import bytes_view

logger = logging.getLogger("titan_recover.syncer")

POLL_S = 0.02
LIVENESS_EVERY_S = 0.2
FINAL_QUIET_S = 1.0
HELLO_EVERY_S = 0.25
SMOOTHING = 0.5


@dataclass
class Round:
    """The open round of one fragment: deltas delivered since its last merge."""

    deltas: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # learner -> per position
    tokens: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    bases: dict[int, Version] = field(default_factory=dict)
    first_at: float | None = None
    quorum_at: float | None = None
    decision: GraceDecision | None = None


@dataclass
class Arrivals:
    """What the syncer learned about one learner's deliveries of one fragment."""

    last_at: float | None = None
    interval_s: float | None = None
    tokens: int = 0

    def record(self, now: float, tokens: int) -> None:
        if self.last_at is not None:
            gap = now - self.last_at
            self.interval_s = gap if self.interval_s is None else SMOOTHING * gap + (1 - SMOOTHING) * self.interval_s
        self.last_at, self.tokens = now, tokens


def _ema(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


class Syncer:
    def __init__(self, config, *, coordinator_address: str, run_dir: str, positions: int, start: int = 0,
                 host: str = "127.0.0.1", port: int = 0):
        self.config = config
        self.cfg = config.recover.diloco
        self.learners, self.positions = config.recover.replicas, positions
        self.blocks = total_blocks(config.training.steps, self.learners)
        self.run_dir = run_dir
        self.coordinator = connect(coordinator_address, timeout_s=config.recover.agree_timeout_s)
        self.store = _serve_store(host, port)
        self.generation = self.coordinator.add(DilocoKeys.GENERATION, 1)
        self.address = f"{host}:{self.store.port}"
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), "syncer", start=start,
                               generation=self.generation)
        self.faults = [f for f in config.chaos.schedule(self.learners, positions)
                       if f.process == "syncer" and f.incarnation == start]
        self.checkpoint_path = os.path.join(run_dir, "syncer", "checkpoint.pt")
        from titan_recover.metrics import JsonlLogger  # imports TorchTitan: after the platform is active

        self.jsonl = JsonlLogger(os.path.join(run_dir, "syncer_metrics.jsonl"))  # step = merges so far
        self.layout: list[dict] = []  # per position: names, shapes, fragment ranges
        self.optimizers: dict[tuple[int, int], OuterOptimizer] = {}
        self.versions: list[int] = []
        self.merges = 0
        self.merged_tokens = 0
        self.merged_step: dict[int, dict[int, int]] = {}
        self.started_at = time.time()
        self.period_s: list[float | None] = []
        self.last_merge_at: list[float | None] = []
        self.rounds: list[Round] = []
        self.arrivals: dict[tuple[int, int], Arrivals] = {}
        self.senders: dict[tuple[int, int], tuple[int, int]] = {}  # (learner, position) -> (incarnation, next no.)
        self.partial: dict[tuple[int, int, int, int], dict[int, tuple[dict, torch.Tensor]]] = {}
        self.alive: set[int] = set()
        self.done: set[int] = set()
        self._liveness_at = 0.0
        self.watch = LivenessWatch(config.recover.heartbeat_timeout_s, math.inf, max_gap_s=2 * LIVENESS_EVERY_S)
        self._hellos_at = 0.0
        self.end_reason = ""
        self._checkpoint_at = time.monotonic()
        self._eval_at = time.monotonic()
        self.validator = None
        self.val_loss: float | None = None
        self.wandb = self._wandb(start) if config.metrics.enable_wandb else None

    def _wandb(self, start: int):
        """TorchTitan's wandb logger, named like the learners' runs (docs/diloco.md): ``<run>-syncer``."""
        metrics = self.config.metrics
        run_name = metrics.wandb_run_name or os.path.basename(self.run_dir)
        for key, value in (("WANDB_MODE", metrics.wandb_mode), ("WANDB_PROJECT", metrics.wandb_project),
                           ("WANDB_RUN_NAME", f"{run_name}-syncer" + (f"-start{start}" if start else "")),
                           ("WANDB_RUN_GROUP", metrics.wandb_group or run_name)):
            os.environ.setdefault(key, value)
        try:
            from torchtitan.components.metrics import WandBLogger

            return WandBLogger(os.path.join(self.run_dir, "syncer"), tag="diloco")
        except Exception as error:  # metrics must never stop the syncer
            logger.warning("wandb unavailable for the syncer: %s", error)
            return None

    # ---- start -------------------------------------------------------------------------------------------
    def publish_address(self) -> None:
        self.coordinator.set(DilocoKeys.SYNCER, f"{self.address} {self.generation}")

    def initialize(self, timeout_s: float) -> None:
        resumed = os.path.exists(self.checkpoint_path)
        if resumed:
            self._load(torch.load(self.checkpoint_path, weights_only=False))
        else:
            self._take_offer(timeout_s)
        fragments = len(self.versions)
        self.rounds = [Round() for _ in range(fragments)]
        for f in range(fragments):
            self._publish(f)
        self.store.set(DilocoKeys.VERSIONS, encode_versions(self.generation, self.versions))
        self.events.emit("syncer_started", resumed=resumed, versions=list(self.versions), merges=self.merges,
                         merged_tokens=self.merged_tokens, fragments=fragments, address=self.address)
        if not resumed:
            self._checkpoint()

    def _take_offer(self, timeout_s: float) -> None:
        """The first learner whose every position offered its parameters gives the initial global model."""
        deadline = time.monotonic() + timeout_s
        while True:
            for learner in range(self.learners):
                keys = [DilocoKeys.meta(DilocoKeys.init(learner, p)) for p in range(self.positions)]
                if all(self.store.check([k]) for k in keys):
                    metas = [json.loads(self.store.get(k)) for k in keys]
                    flats = [get_blob(self.store, DilocoKeys.init(learner, p), m["bytes"]).view(torch.float32)
                             for p, m in enumerate(metas)]
                    self._build(metas, flats)
                    self.events.emit("initial_model", from_learner=learner,
                                     parameters=sum(f.numel() for f in flats))
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("no learner offered its parameters within recover.startup_timeout_s")
            time.sleep(POLL_S)

    def _build(self, metas: list[dict], flats: list[torch.Tensor]) -> None:
        self.layout = [{"names": m["names"], "shapes": m["shapes"], "ranges": m["ranges"],
                        "global_shapes": m["global_shapes"]} for m in metas]
        fragments = len(metas[0]["ranges"])
        for p, (meta, flat) in enumerate(zip(metas, flats)):
            sizes = [int(torch.Size(s).numel()) for s in meta["shapes"]]
            offsets = [0]
            for n in sizes:
                offsets.append(offsets[-1] + n)
            for f, (start, end) in enumerate(meta["ranges"]):
                self.optimizers[(f, p)] = OuterOptimizer(flat[offsets[start] : offsets[end]], self.cfg.outer_lr,
                                                         self.cfg.outer_momentum)
        self.versions = [0] * fragments
        self.period_s = [None] * fragments
        self.last_merge_at = [None] * fragments

    # ---- state -------------------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"layout": self.layout, "versions": list(self.versions), "merges": self.merges,
                "merged_tokens": self.merged_tokens, "merged_step": self.merged_step,
                "started_at": self.started_at, "period_s": list(self.period_s),
                "optimizers": {f"{f}/{p}": o.state_dict() for (f, p), o in self.optimizers.items()}}

    def _load(self, state: dict) -> None:
        self.layout = state["layout"]
        fragments = len(state["versions"])
        for key, saved in state["optimizers"].items():
            f, p = (int(v) for v in key.split("/"))
            optimizer = OuterOptimizer(saved["parameter"], self.cfg.outer_lr, self.cfg.outer_momentum)
            optimizer.load_state_dict(saved)
            self.optimizers[(f, p)] = optimizer
        self.versions = list(state["versions"])
        self.merges, self.merged_tokens = state["merges"], state["merged_tokens"]
        self.merged_step = {int(k): {int(f): s for f, s in v.items()} for k, v in state["merged_step"].items()}
        self.started_at = state["started_at"]
        self.period_s = list(state["period_s"])
        self.last_merge_at = [None] * fragments

    def _checkpoint(self) -> None:
        """Written to a temporary file and renamed: a crash while saving leaves the previous checkpoint."""
        os.makedirs(os.path.dirname(self.checkpoint_path), exist_ok=True)
        tmp = self.checkpoint_path + ".tmp"
        torch.save(self._state(), tmp)
        os.replace(tmp, self.checkpoint_path)
        self._checkpoint_at = time.monotonic()

    def _publish(self, f: int) -> None:
        version = self.versions[f]
        for p in range(self.positions):
            prefix = DilocoKeys.fragment(f, p, version)
            nbytes = put_blob(self.store, prefix, bytes_view(self.optimizers[(f, p)].parameter))
            self.store.set(DilocoKeys.meta(prefix), str(nbytes))
            old = DilocoKeys.fragment(f, p, version - 2)  # a learner may still be reading the previous version
            if version >= 2 and self.store.check([DilocoKeys.meta(old)]):
                delete_blob(self.store, old, int(self.store.get(DilocoKeys.meta(old))))
                self.store.delete_key(DilocoKeys.meta(old))

    # ---- learners ----------------------------------------------------------------------------------------
    def _judge_liveness(self) -> None:
        alive, done, beats = set(), set(), {}
        ranks = self.positions
        for learner in range(self.learners):
            if all(self.coordinator.check([Keys.done(learner, r)]) for r in range(ranks)):
                done.add(learner)
                continue
            keys = [Keys.heartbeat(learner, r) for r in range(ranks)]
            if all(self.coordinator.check([k]) for k in keys):
                beats[learner] = [Heartbeat.decode(raw) for raw in self.coordinator.multi_get(keys)]
        # judged on the syncer's own clock, over the time it watched (a merge that kept it busy is not held against
        # the learners); any start of a learner counts: its restart is alive
        self.watch.look(time.monotonic(), {(learner, r): b for learner, bs in beats.items() for r, b in enumerate(bs)})
        for learner, bs in beats.items():
            if self.watch.judge(learner, range(ranks), bs[0].incarnation).alive:
                alive.add(learner)
        for learner in sorted(self.alive - alive - done):
            given_back = requeue_block(self.coordinator, learner, f"syncer.{self.generation}")
            self.events.emit("learner_lost", learner=learner, reason="no heartbeat", requeued_block=given_back)
        self.alive, self.done = alive, done

    def _read_hellos(self) -> None:
        """Which incarnation sends from each (learner, position): a new one numbers its deltas from 0."""
        for learner in range(self.learners):
            for p in range(self.positions):
                hello = DilocoKeys.hello(learner, p)
                if self.store.check([hello]):
                    incarnation = int(self.store.get(hello))
                    if self.senders.get((learner, p), (-1, 0))[0] != incarnation:
                        self.senders[(learner, p)] = (incarnation, 0)
        self._hellos_at = time.monotonic()

    def _receive(self, now: float) -> int:
        if time.monotonic() - self._hellos_at > HELLO_EVERY_S:
            self._read_hellos()
        received = 0
        for (learner, p), (incarnation, number) in list(self.senders.items()):
            while True:
                prefix = DilocoKeys.delta(learner, incarnation, p, number)
                if not self.store.check([DilocoKeys.meta(prefix)]):
                    break
                meta = json.loads(self.store.get(DilocoKeys.meta(prefix)))
                data = get_blob(self.store, prefix, meta["bytes"]).view(torch.float32).clone()
                delete_blob(self.store, prefix, meta["bytes"])
                self.store.delete_key(DilocoKeys.meta(prefix))
                number += 1
                received += 1
                parts = self.partial.setdefault((learner, incarnation, meta["fragment"], meta["step"]), {})
                parts[p] = (meta, data)
                if len(parts) == self.positions:
                    del self.partial[(learner, incarnation, meta["fragment"], meta["step"])]
                    self._deliver(learner, meta, [parts[q][1] for q in range(self.positions)], now)
            self.senders[(learner, p)] = (incarnation, number)
        return received

    def _deliver(self, learner: int, meta: dict, deltas: list[torch.Tensor], now: float) -> None:
        f = meta["fragment"]
        r = self.rounds[f]
        if learner in r.deltas:  # a second delta before its round closed: progress adds up
            for held, new in zip(r.deltas[learner], deltas):
                held += new
            r.tokens[learner] += meta["tokens"]
            r.steps[learner] = max(r.steps[learner], meta["step"])
        else:
            r.deltas[learner], r.tokens[learner], r.steps[learner] = deltas, meta["tokens"], meta["step"]
            r.bases[learner] = tuple(meta["base"])
        r.first_at = r.first_at or now
        self.arrivals.setdefault((learner, f), Arrivals()).record(now, meta["tokens"])

    # ---- rounds ------------------------------------------------------------------------------------------
    def _sync_period(self, f: int) -> float | None:
        if self.period_s[f] is not None:
            return self.period_s[f]
        intervals = [a.interval_s for (_, g), a in self.arrivals.items() if g == f and a.interval_s]
        return statistics.median(intervals) if intervals else None

    def _maybe_merge(self, f: int, now: float, final: bool = False) -> None:
        r = self.rounds[f]
        if not r.deltas:
            return
        expected = self.alive - set(r.deltas)
        quorum = min(self.cfg.min_quorum, len(self.alive | set(r.deltas)))
        if not final:
            if len(r.deltas) < quorum:
                return
            if r.quorum_at is None:
                r.quorum_at = now
                period = self._sync_period(f)
                pending = {}
                for j in expected:
                    seen = self.arrivals.get((j, f))
                    if seen is not None and seen.interval_s is not None:
                        pending[j] = (seen.last_at + seen.interval_s - now, seen.tokens)
                if period:
                    r.decision = grace_window(r.tokens, pending, period, self.cfg.max_window_s)
                else:
                    r.decision = GraceDecision(0.0, (), "merge now: no sync period measured yet")
            waiting = [j for j in r.decision.waiting_for if j in expected]
            if waiting and now < r.quorum_at + r.decision.deadline_s:
                return
        self._merge(f, now, quorum, final)

    def _merge(self, f: int, now: float, quorum: int, final: bool) -> None:
        r = self.rounds[f]
        learners = sorted(r.deltas)
        for p in range(self.positions):
            outer_gradient = merge_deltas({i: r.deltas[i][p] for i in learners}, r.tokens)
            self.optimizers[(f, p)].step(outer_gradient)
        before = self.versions[f]
        self.versions[f] += 1
        self._publish(f)
        self.store.set(DilocoKeys.VERSIONS, encode_versions(self.generation, self.versions))
        staleness = {str(i): (before - r.bases[i][1] if r.bases[i][0] == self.generation else None)
                     for i in learners}
        # a token is in the global model once every fragment merged its progress: each fragment's merge counts
        # its share of the parameters (fragments are near-equal in size)
        self.merges += 1
        self.merged_tokens += sum(r.tokens.values()) / len(self.versions)
        for i in learners:
            steps = self.merged_step.setdefault(i, {})
            steps[f] = max(steps.get(f, 0), r.steps[i])
        if self.last_merge_at[f] is not None:
            self.period_s[f] = _ema(self.period_s[f], now - self.last_merge_at[f])
        self.last_merge_at[f] = now
        weights = token_weights(r.tokens)
        decision = r.decision
        record = {
            "fragment": f, "version": self.versions[f], "learners": learners,
            "tokens": {str(i): r.tokens[i] for i in learners},
            "weights": {str(i): weights[i] for i in learners}, "staleness": staleness,
            "alive": sorted(self.alive), "quorum": quorum, "under_quorum": quorum < self.cfg.min_quorum,
            "quorum_wait_s": (r.quorum_at - r.first_at) if r.quorum_at else None,
            "window_s": (now - r.quorum_at) if r.quorum_at else 0.0,
            "window_deadline_s": decision.deadline_s if decision else 0.0,
            "waited_for": list(decision.waiting_for) if decision else [],
            "window_reason": decision.reason if decision else "final merge",
            "final": final,
        }
        self.events.emit("fragment_merged", **record)
        self.rounds[f] = Round()
        self._log_metrics(now, merge=record)
        for fault in self.faults:
            if fault.step == self.merges:
                from titan_recover.recover.chaos.monkey import FAULTS

                self.events.emit("fault_injected", kind=fault.kind, step=self.merges, phase="merge", pid=os.getpid(),
                                 process="syncer")
                FAULTS.get(fault.kind)(None, fault)

    # ---- metrics -----------------------------------------------------------------------------------------
    def goodput(self, now: float) -> float:
        return self.merged_tokens / max(now - self.started_at, 1e-9)

    def _log_metrics(self, now: float, merge: dict | None = None, val_loss: float | None = None) -> None:
        record = {"elapsed_s": now - self.started_at, "merges": self.merges,
                  "merged_tokens": self.merged_tokens, "goodput_tokens_per_s": self.goodput(now),
                  "alive": len(self.alive)}
        if merge is not None:
            staleness = [s for s in merge["staleness"].values() if s is not None]
            record.update({"fragment": merge["fragment"], "version": merge["version"],
                           "quorum_size": len(merge["learners"]), "window_s": merge["window_s"],
                           "staleness_mean": sum(staleness) / len(staleness) if staleness else None})
        if val_loss is not None:
            record["val_loss"] = val_loss
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=self.merges)
        self.jsonl.log(record, step=self.merges)

    def global_parameters(self) -> dict[str, torch.Tensor] | None:
        """The global model by name (see :func:`assemble_rows`), or None for layouts it cannot assemble."""
        flats = [torch.cat([self.optimizers[(f, p)].parameter.detach().reshape(-1)
                            for f in range(len(self.versions))]) for p in range(self.positions)]
        return assemble_rows(self.layout, flats)

    def evaluate(self, now: float) -> float | None:
        parameters = self.global_parameters()
        if parameters is None:
            return None
        if self.validator is None:
            from titan_recover.evaluate import Validator

            from titan_recover.config.validate import resolve_layout

            layout = resolve_layout(self.config.parallelism, self.positions)  # a learner's mesh
            self.validator = Validator(self.config, self.cfg.eval_microbatches, shard_degree=layout.dp_shard)
        self.val_loss = self.validator.loss(parameters)
        self._eval_at = time.monotonic()
        self._log_metrics(now, val_loss=self.val_loss)
        self.events.emit("global_evaluated", merges=self.merges, versions=list(self.versions), val_loss=self.val_loss,
                         merged_tokens=self.merged_tokens)
        return self.val_loss

    # ---- loop --------------------------------------------------------------------------------------------
    def run(self) -> int:
        self.publish_address()
        self.initialize(self.config.recover.startup_timeout_s)
        self.evaluate(time.time())
        quiet_since = None
        while True:
            now = time.time()
            if now - self._liveness_at > LIVENESS_EVERY_S:
                self._judge_liveness()
                self._liveness_at = now
            received = self._receive(now)
            for f in range(len(self.versions)):
                self._maybe_merge(f, now)
            if time.monotonic() - self._checkpoint_at > self.cfg.checkpoint_interval_s:
                self._checkpoint()
            if self.cfg.eval_interval_s and time.monotonic() - self._eval_at > self.cfg.eval_interval_s:
                self.evaluate(now)
            if self._over():
                quiet_since = None if received else (quiet_since or time.monotonic())
                if quiet_since is not None and time.monotonic() - quiet_since > FINAL_QUIET_S:
                    return self.finish()
            time.sleep(POLL_S)

    def _over(self) -> bool:
        """Every learner ended, or the budget is trained and every live learner has sent its last deltas (a learner
        still restarting is not waited for: the blocks it held were given back and trained by others)."""
        if self.coordinator.check([DilocoKeys.LEARNERS_OVER]):
            self.end_reason = "every learner ended"
            return True
        trained = int(self.coordinator.add(DilocoKeys.BLOCKS_DONE, 0))
        if trained >= self.blocks and not self.alive:
            self.end_reason = f"the budget's {self.blocks} blocks are trained and no learner is running"
            return True
        return False

    def finish(self) -> int:
        """Every learner ended: merge what is left, evaluate, save the global model and the checkpoint."""
        now = time.time()
        for f in range(len(self.versions)):
            self._maybe_merge(f, now, final=True)
        val_loss = self.evaluate(now)
        parameters = self.global_parameters()
        if parameters is not None:
            path = os.path.join(self.run_dir, "diloco_global.pt")
            torch.save(parameters, path + ".tmp")
            os.replace(path + ".tmp", path)
        self._checkpoint()
        self.events.emit("syncer_finished", reason=self.end_reason, merges=self.merges,
                         blocks_done=int(self.coordinator.add(DilocoKeys.BLOCKS_DONE, 0)), merged_tokens=self.merged_tokens,
                         goodput_tokens_per_s=self.goodput(now), elapsed_s=now - self.started_at, val_loss=val_loss,
                         versions=list(self.versions))
        if self.wandb is not None:
            self.wandb.close()
        self.coordinator.set(Keys.FINISHED, "1")
        return 0


def assemble_rows(layout: list[dict], flats: list[torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Whole parameters by name from every position's flat local shards (``layout[p]``: names, shapes,
    global_shapes): concatenated along dim 0 in position order when that gives the whole shape (one process per
    learner, FSDP2's row shards); None for other layouts (TP's column shards, PP's stages)."""
    per_position = []
    for meta, flat in zip(layout, flats):
        shards, at = {}, 0
        for name, shape in zip(meta["names"], meta["shapes"]):
            n = int(torch.Size(shape).numel())
            shards[name] = flat[at : at + n].view(shape)
            at += n
        per_position.append(shards)
    first = layout[0]
    out = {}
    for name, whole in zip(first["names"], first.get("global_shapes", first["shapes"])):
        if any(name not in shards for shards in per_position):
            return None
        parts = [shards[name] for shards in per_position]
        joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0) if parts[0].dim() else None
        if joined is None or list(joined.shape) != list(whole):
            return None
        out[name] = joined.clone()
    return out


def _serve_store(host: str, port: int):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator's store")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--positions", type=int, required=True, help="ranks per learner")
    parser.add_argument("--start", type=int, default=0, help="how many times the syncer was started before")
    parser.add_argument("--host", default="127.0.0.1", help="address the learners reach this node at")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[syncer] %(asctime)s %(message)s")
    from titan_recover import platform

    platform.activate()
    from titan_recover.config.loader import build_config

    toml_path = rest.pop(0) if rest and not rest[0].startswith("--") else None
    config = build_config(toml_path, rest)
    torch.set_num_threads(1)
    syncer = Syncer(config, coordinator_address=args.coordinator, run_dir=args.run_dir, positions=args.positions,
                    start=args.start, host=args.host, port=config.recover.diloco.syncer_port if args.start == 0 else 0)
    return syncer.run()


if __name__ == "__main__":
    sys.exit(main())
