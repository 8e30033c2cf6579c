"""``[recover] mode = "diloco"``: the replica group is a Decoupled DiLoCo learner (docs/diloco.md).

TorchTitan's own step trains the learner's data block; before every step the learner claims the next block from
the job's counter (no block left: training ends), after it the learner sends its due fragments to the syncer and
mixes in newer global ones. The main thread reports progress at every microbatch (the syncer's progress timeout;
and the hang observer's beacon with ``[recover.localize] hang_threshold_s > 0``).
"""

from __future__ import annotations

from functools import partial
import logging
import os

import torch

from titan_recover.recover.chaos.monkey import ChaosMonkey
from titan_recover.recover.diloco.learner import BlockGivenBack, Learner
from titan_recover.recover.events import EventLog
from titan_recover.recover.groups.member import EXIT_EXCLUDED, incarnation_from_env, replica_group_store, ReplicaMember
from titan_recover.recover.modes.base import Mode, register_mode, TrainerParts
from titan_recover.recover.modes.single import forward_backward_with_faults
from titan_recover.recover.modes.sync import replica_environment
from titan_recover.recover.scout.beacon import Beacon, beacon_path

logger = logging.getLogger(__name__)


@register_mode("diloco")
class DilocoMode(Mode):
    def __init__(self, config, *, parts: TrainerParts):
        super().__init__(config, parts=parts)
        learner, address, run_dir = replica_environment(config)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        incarnation = incarnation_from_env()
        self.events = events = EventLog(os.path.join(run_dir, "events.jsonl"), f"{learner}/{rank}", replica=learner,
                                        rank=rank)
        self.step = 0
        self.chaos = ChaosMonkey(config.chaos.schedule(config.recover.groups, world), learner, rank, events,
                                 incarnation=incarnation, run_dir=run_dir)
        parts.optimizers.register_step_pre_hook(lambda *_: self.chaos.maybe_inject(self.step, "optimizer"))
        self.member = ReplicaMember(config.recover, replica=learner, rank=rank, ranks_per_replica=world,
                                    address=address, incarnation=incarnation,
                                    group_store=partial(replica_group_store, config.recover.agree_timeout_s)
                                    if world > 1 else None)
        if config.recover.localize.hang_threshold_s > 0:  # read by the learner's hang observer (docs/scout.md)
            self.member.beacon = Beacon(beacon_path(run_dir, learner, rank, incarnation))
        self.member.register()
        self.learner = Learner(parts, self.member, events, learner=learner, learners=config.recover.replicas,
                               incarnation=incarnation, coordinator_address=address)

    def start(self, step: int) -> int:
        """A restarted learner continues the job's step count."""
        return self.learner.start(self.config.recover.startup_timeout_s, step)

    def should_continue(self, scheduled: bool) -> bool:
        return self.learner.has_work()

    def local_batches(self, step: int):
        yield from self.learner.local_batch_indices()

    def train_step(self, step: int, titan_step) -> None:
        self.step = step
        if self.parts.metrics_processor.should_log(step):
            self.parts.metrics_processor.add_step_metrics(self.learner.metrics())
        titan_step()
        try:
            self.learner.after_inner_step(step)
        except BlockGivenBack as given_back:  # taken for lost, and it was not: end; the launcher restarts it
            logger.error("%s", given_back)
            self.events.emit("learner_ended", step=step, block=self.learner.block, reason=str(given_back))
            os._exit(EXIT_EXCLUDED)
        self.chaos.maybe_inject(step, "block_end")  # the block is counted; the next is not claimed yet

    def forward_backward(self, step: int, **batch) -> torch.Tensor:
        self.member.progress(step=step, phase="forward")
        return forward_backward_with_faults(self.parts, self.chaos, step, batch)

    def train(self, run) -> None:
        run()
        self.learner.finish()  # done already when the budget ran out (has_work)
        if self.member.beacon is not None:
            self.member.beacon.close(done=True)
        return None

    def close(self) -> None:
        self.learner.close()
        self.member.close()
