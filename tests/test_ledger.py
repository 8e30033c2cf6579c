"""The exactly-once ledger and the step recovery manager, without processes.

``SimulatedReplicas`` runs the manager of every replica of a step in one process against a fake coordinator:
failures are scripted per (replica, phase), the "reduction" sums what the live replicas packed, and the test
checks what every replica computed and what the step committed.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from titan_recover.recover.config import QuotaConfig
from titan_recover.recover.invariant.ledger import LedgerError, StepLedger
from titan_recover.recover.invariant.step_recovery import StepConfig, StepRecovery


def ledger(policy="even", members=(0, 1, 2, 3), per_step=8, step=2, replicas=4, speeds=None):
    return StepLedger(policy, step, per_step, members, epoch=5, replicas=replicas, speeds=speeds or {})


def test_ledger_starts_from_the_policy_and_takes_over_lost_ids_in_epoch_order():
    book = ledger()
    assert book.ids(1) == (9, 13) and book.first == 8
    moved = book.advance(6, [0, 2, 3])
    assert moved.lost == (1,) and sorted(itertools.chain(*moved.extra.values())) == [9, 13]
    assert book.recomputed == 2
    again = book.advance(7, [0, 3])
    assert again.lost == (2,)
    held = sorted(itertools.chain(*(book.ids(m) for m in (0, 3))))
    assert held == list(range(8, 16))  # every id of the step, once, after two losses
    assert book.ids(2) == () and book.ids(1) == ()
    with pytest.raises(ValueError, match="next is 8"):
        book.advance(9, [0, 3])


def test_a_spare_holds_no_ids_until_it_takes_over_a_lost_replicas():
    book = StepLedger("even", 2, 6, (0, 1, 2, 3), epoch=0, replicas=3, active=3)
    assert book.ids(3) == () and book.quota(3) == 0 and sorted(book.ids(0) + book.ids(1) + book.ids(2)) == \
        list(range(6, 12))
    lost_ids = book.ids(1)
    moved = book.advance(1, [0, 2, 3])  # replica 1 lost mid-step: the idle spare takes its ids (load-aware)
    assert moved.lost == (1,) and moved.extra == {3: lost_ids}
    held = sorted(itertools.chain(*(book.ids(m) for m in (0, 2, 3))))
    assert held == list(range(6, 12))  # exactly once
    # the next step's plan starts from members without 1: the spare is one of the three holding quota
    nxt = StepLedger("even", 3, 6, (0, 2, 3), epoch=1, replicas=3, active=3)
    assert [nxt.quota(m) for m in (0, 2, 3)] == [2, 2, 2]


def test_ledger_check_accepts_exactly_once_only():
    book = ledger()
    vectors = [book.vector(book.ids(m)) for m in range(4)]
    reduced = [sum(column) for column in zip(*vectors)]
    assert book.check(reduced) == 8
    twice = list(reduced)
    twice[3] += 1
    with pytest.raises(LedgerError, match=r"counted too often \[11\]"):
        book.check(twice)
    missing = list(reduced)
    missing[0] = 0
    with pytest.raises(LedgerError, match=r"missing ids \[8\]"):
        book.check(missing)
    with pytest.raises(LedgerError, match="not an id of step 2"):
        book.vector([99])


def test_drop_keeps_fixed_shares_and_commits_fewer():
    book = ledger("drop", members=(0, 1, 3))  # replica 2 already gone: its share is not computed
    assert book.ids(0) == (8, 12) and book.ids(2) == ()
    book.advance(6, [0, 3])
    assert book.ids(0) == (8, 12) and book.recomputed == 0
    reduced = [a + b for a, b in zip(book.vector(book.ids(0)), book.vector(book.ids(3)))]
    assert book.check(reduced) == 4


def test_every_holder_lost_is_an_error():
    book = ledger(members=(0, 1))
    with pytest.raises(LedgerError, match="every replica"):
        book.advance(6, [2])


class FakeEvents:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})


class SimulatedReplicas:
    """The replicas of one step, each manager in its own thread, against a fake coordinator: a scripted death
    publishes the next epoch without the dead replica; an epoch's reduction commits once every member packed in
    it, and aborts (the rank moves to the newest epoch) when a newer epoch appears first."""

    def __init__(self, replicas: int, per_step: int, policy: str = "even", dies: dict[int, str] | None = None,
                 abort_recovery: str = "backup", overlap: bool = False):
        self.replicas, self.per_step, self.policy = replicas, per_step, policy
        self.abort_recovery, self.overlap = abort_recovery, overlap
        self.issued: dict[int, list[str]] = {r: [] for r in range(replicas)}
        """Per replica: "issue" when the collective issued a tensor, "final" when the worker reported its part."""
        self.dies = dict(dies or {})
        self.epochs = {0: tuple(range(replicas))}
        self.packed: dict[int, dict[int, torch.Tensor]] = {}
        self.computed: dict[int, list[int]] = {r: [] for r in range(replicas)}
        self.changed = threading.Condition()

    def lose(self, replica: int) -> None:
        with self.changed:
            last = max(self.epochs)
            self.epochs[last + 1] = tuple(m for m in self.epochs[last] if m != replica)
            self.changed.notify_all()

    @staticmethod
    def value(g: int) -> torch.Tensor:
        return torch.tensor([g + 1.0, 2.0 ** -g, 1.0], dtype=torch.float64)

    def sync(self, replica: int):
        sim = self

        class Sync:
            def __init__(self):
                self.epoch, self.members = 0, sim.epochs[0]
                self.committed_epoch, self.committed_members = 0, sim.epochs[0]
                self.recoveries, self.events = [], FakeEvents()

            def catch_up(self, _step):
                with sim.changed:
                    self.epoch = max(sim.epochs)
                    self.members = sim.epochs[self.epoch]

            def members_of(self, epoch):
                return sim.epochs[epoch]

            def collective(self):
                def issue(tensors, before_piece):  # the pieces go out as the gates open; the sums come in join
                    for i, t in enumerate(tensors):
                        before_piece(i, 0, t.view(-1))
                        sim.issued[replica].append("issue")
                return self.epoch, issue

            def reduce_once(self, _step, tensors, attempt=1, verify=None, before_piece=None, pending=None):
                if pending is not None:
                    assert pending.epoch == self.epoch
                    pending.join()
                if sim.dies.get(replica) == "reduction":
                    with sim.changed:  # lost in the reduction: once the others are in it too (not before they plan)
                        others = len(self.members) - 1
                        assert sim.changed.wait_for(lambda: len(sim.packed.get(self.epoch, {})) >= others, 10)
                    sim.lose(replica)
                    raise SystemExit
                for i, t in enumerate(tensors):  # the collective is about to write each tensor
                    if before_piece is not None:
                        before_piece(i, 0, t.view(-1))
                with sim.changed:
                    packed = sim.packed.setdefault(self.epoch, {})
                    packed[replica] = [t.clone() for t in tensors]
                    sim.changed.notify_all()
                    complete = lambda: set(packed) == set(self.members)
                    superseded = lambda: max(sim.epochs) > self.epoch
                    assert sim.changed.wait_for(lambda: complete() or superseded(), timeout=10)
                    if complete():
                        for i, t in enumerate(tensors):
                            t.copy_(sum(p[i] for p in packed.values()))
                        self.committed_epoch, self.committed_members = self.epoch, self.members
                        return True
                    for t in tensors:  # an abandoned reduction leaves partial sums behind
                        t.add_(1000.0)
                    self.epoch = max(sim.epochs)
                    self.members = sim.epochs[self.epoch]
                    return False

        return Sync()

    def run_step(self, step: int) -> dict:
        """Run every replica's manager for ``step``; returns replica -> outcome, or "dead"."""
        outcomes: dict[int, object] = {}

        def replica_main(r: int) -> None:
            sim = self

            class Worker:
                numel = 3

                def __init__(self):
                    self.local = torch.zeros(3, dtype=torch.float64)

                def compute(self, g, witness=None, on_final=None):
                    if sim.dies.get(r) == "forward":
                        sim.lose(r)
                        raise SystemExit
                    sim.computed[r].append(g)
                    self.local.add_(sim.value(g))
                    if on_final is not None:
                        sim.issued[r].append("final")
                        on_final(0)

                def gradient_parts(self):
                    return [self.local] if sim.overlap else None

                def needs_backward(self):
                    return False

                def synchronize(self):
                    pass

                def contribution(self):
                    return self.local, torch.zeros(()), 0.0

                def replace_gradient(self, parts):
                    (self.local,) = parts

                def discard(self):
                    self.local = torch.zeros(3, dtype=torch.float64)

            manager = StepRecovery(QuotaConfig(policy=self.policy), replica=r, groups=self.replicas,
                                   per_step=self.per_step, sync=self.sync(r), worker=Worker(), dtype=torch.float64,
                                   config=StepConfig(abort_recovery=self.abort_recovery))
            try:
                outcomes[r] = manager.run(step)
            except SystemExit:
                outcomes[r] = "dead"

        threads = [threading.Thread(target=replica_main, args=(r,)) for r in range(self.replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
            assert not t.is_alive()
        return outcomes


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["after", "overlapped"])
"""The reduction issued after the last microbatch, or during its backward (tests/test_overlap.py)."""


@OVERLAP
def test_manager_a_replica_lost_in_forward_has_its_ids_computed_by_survivors(overlap):
    sim = SimulatedReplicas(replicas=3, per_step=6, dies={1: "forward"}, overlap=overlap)
    outcomes = sim.run_step(step=1)
    assert outcomes[1] == "dead"
    survivors = [outcomes[0], outcomes[2]]
    assert {o.committed for o in survivors} == {6}
    everything = sorted(sim.computed[0] + sim.computed[2])
    assert everything == list(range(6))  # replica 1 computed nothing; all ids once
    expected = sum(sim.value(g) for g in range(6))
    for o in survivors:
        assert torch.equal(o.reduced.gradient[0], expected)
        assert o.recomputed == 2 and o.quotas == {0: 2, 1: 2, 2: 2}


@OVERLAP
def test_manager_a_replica_lost_in_reduction_keeps_the_survivors_accumulation(overlap):
    sim = SimulatedReplicas(replicas=3, per_step=6, dies={2: "reduction"}, overlap=overlap)
    outcomes = sim.run_step(step=1)
    assert outcomes[2] == "dead"
    for r in (0, 1):
        assert outcomes[r].committed == 6
        assert torch.equal(outcomes[r].reduced.gradient[0], sum(sim.value(g) for g in range(6)))
    # replica 2's two ids were recomputed by the survivors on top of what they had
    assert sorted(sim.computed[0] + sim.computed[1]) == list(range(6))


@OVERLAP
def test_manager_without_a_backup_computes_its_own_ids_again_after_an_aborted_reduction(overlap):
    # the abandoned reduction leaves garbage in the survivors' gradients (the simulated sync adds 1000): without a
    # backup each survivor starts again from nothing, computes its own ids in their first order, then replica 2's
    sim = SimulatedReplicas(replicas=3, per_step=6, dies={2: "reduction"}, abort_recovery="recompute",
                            overlap=overlap)
    outcomes = sim.run_step(step=1)
    assert outcomes[2] == "dead"
    for r in (0, 1):
        assert outcomes[r].committed == 6 and outcomes[r].attempts == 2
        assert torch.equal(outcomes[r].reduced.gradient[0], sum(sim.value(g) for g in range(6)))
        own, again, taken = sim.computed[r][:2], sim.computed[r][2:4], sim.computed[r][4:]
        assert again == own, "the own ids were not computed again, in their first order"
        assert len(taken) == 1
    # every id accumulated once in what was committed: each survivor's own two, and one of replica 2's each
    assert sorted(sim.computed[0][:2] + sim.computed[0][4:] + sim.computed[1][:2] + sim.computed[1][4:]) == \
        list(range(6))


def test_manager_overlaps_the_reduction_with_the_last_microbatch_and_commits_it():
    sim = SimulatedReplicas(replicas=3, per_step=6, overlap=True)
    outcomes = sim.run_step(step=1)
    for r in range(3):
        assert outcomes[r].overlapped and outcomes[r].attempts == 1 and outcomes[r].committed == 6
        assert torch.equal(outcomes[r].reduced.gradient[0], sum(sim.value(g) for g in range(6)))
        # only the last of its two microbatches reports final parts; the gradient and the tail go out after it
        assert sim.issued[r] == ["final", "issue", "issue"]


def test_manager_drop_discards_the_failed_step_and_commits_fewer():
    sim = SimulatedReplicas(replicas=3, per_step=6, policy="drop", dies={1: "reduction"})
    outcomes = sim.run_step(step=1)
    for r in (0, 2):
        assert outcomes[r].committed == 4 and outcomes[r].discarded and outcomes[r].recomputed == 0


class IdleWorker:
    """A worker whose microbatches add nothing (the manager's bookkeeping alone is under test)."""

    numel = 1

    def compute(self, g, witness=None):
        return None

    def synchronize(self):
        pass

    def contribution(self):
        return torch.zeros(1), torch.zeros(()), 0.0

    def replace_gradient(self, parts):
        pass

    def gradient_parts(self):
        return None

    def needs_backward(self):
        return False


def test_a_spare_that_never_ran_a_backward_computes_one_microbatch_and_drops_it():
    """A worker that must see a backward before it can place gradients of its own (a tensor-parallel norm weight's
    is Partial while its parameter is Replicate) and holds no microbatch of the step (a spare) computes the step's
    first id as a replay (dropped: nothing accumulated) before the reduction; once it has seen one, it computes
    nothing."""

    class TwoMembers:
        epoch, members, committed_epoch, committed_members = 0, (0, 1), 0, (0, 1)

    class Spare(IdleWorker):
        def __init__(self):
            self.seen, self.calls = False, []

        def compute(self, g, witness=None, on_final=None):
            self.calls.append((g, witness))
            self.seen = True

        def needs_backward(self):
            return not self.seen

    spare = Spare()
    manager = StepRecovery(QuotaConfig(), replica=1, groups=2, per_step=4, sync=TwoMembers(), worker=spare,
                           active=1, dtype=torch.float64)
    ledger = manager.plan(1)
    assert ledger.assignment.ids == {0: (0, 1, 2, 3)}  # the spare holds none
    progress, _ = manager._compute_quota(1, ledger)
    assert spare.calls == [(0, "replay")] and progress.done == []  # computed, dropped, not counted as its work
    manager._compute_quota(2, manager.plan(2))
    assert spare.calls == [(0, "replay")]  # seen: nothing more


def test_manager_gives_up_after_the_epoch_bound():
    class NeverCommits:
        epoch, members, committed_epoch, committed_members = 0, (0, 1), 0, (0, 1)
        recoveries, events = [], FakeEvents()

        def catch_up(self, _step):
            pass

        def reduce_once(self, *_args, verify=None, before_piece=None, pending=None):
            return False

    manager = StepRecovery(QuotaConfig(), replica=0, groups=2, per_step=2, sync=NeverCommits(), worker=IdleWorker(),
                           config=StepConfig(max_epochs_per_step=2))
    with pytest.raises(RuntimeError, match="failed in 3 consecutive epochs"):
        manager.run(1)


def test_manager_smooths_committed_speeds_and_the_next_plan_uses_them():
    manager = StepRecovery(QuotaConfig(policy="throughput", speed_smoothing=0.5), replica=0, groups=3,
                           per_step=10, sync=None, worker=IdleWorker())
    manager._update_speeds([2.0, 0.0, 1.0])  # replica 1 computed nothing: no measurement
    manager._update_speeds([4.0, 1.0, 1.0])
    assert manager.speeds == {0: 3.0, 1: 1.0, 2: 1.0}

    class Committed:
        committed_epoch, committed_members = 3, (0, 1, 2)

    manager.sync = Committed()
    plan = manager.plan(step=2)
    assert {m: plan.quota(m) for m in (0, 1, 2)} == {0: 6, 1: 2, 2: 2}  # 3 : 1 : 1


def test_reduction_layout_packs_and_reads_every_section():
    from titan_recover.recover.invariant.reduction import ReductionLayout

    layout = ReductionLayout(gradients=3, microbatches=4, groups=2, evidence=2)
    sections = dict(dtype=torch.float64, device=torch.device("cpu"))
    tail = layout.tail(loss=torch.tensor(0.5), ledger=[1, 0, 1, 0], speeds=[2.0, 0.0], losses=[7.0, 0.0],
                       evidence=[5.0, 6.0], failed=True, **sections)
    assert tail.numel() == layout.tail_size == 1 + 4 + 2 * 2 + 2 + 1
    summed = tail + layout.tail(loss=torch.tensor(0.25), ledger=[0, 1, 0, 1], speeds=[0.0, 3.0], losses=[0.0, 8.0],
                                evidence=[0.0, 0.0], failed=False, **sections)
    parts = [torch.tensor([2.0, 3.0]), torch.tensor([4.0])]
    layout.check(parts)
    reduced = layout.read(parts, summed)
    assert reduced.gradient is parts and reduced.loss == 0.75
    assert reduced.ledger == [1, 1, 1, 1] and reduced.speeds == [2.0, 3.0] and reduced.losses == [7.0, 8.0]
    assert reduced.evidence == [5.0, 6.0] and reduced.failed
    with pytest.raises(ValueError, match="do not fit the layout"):
        layout.tail(loss=torch.tensor(0.0), ledger=[0] * 4, speeds=[0.0], losses=[0.0, 0.0], evidence=[0.0, 0.0],
                    failed=False, **sections)
    with pytest.raises(ValueError, match="gradient has 2 elements, the layout 3"):
        layout.check([torch.zeros(2)])


def test_an_aborted_reduction_is_undone_from_the_backup_into_fresh_storage():
    """Pieces are saved just before the collective writes them; after an abort the parts come back as they were,
    in new tensors, whatever the collective wrote (and may still write) into the old ones."""
    from titan_recover.recover.ftpg.polled import pieces_of
    from titan_recover.recover.invariant.reduction import Backup

    parts = [torch.arange(10.0), torch.arange(4, dtype=torch.float64), torch.arange(6.0)]
    before = [p.clone() for p in parts]
    backup = Backup()
    backup.begin(parts)
    pieces = pieces_of([*parts, torch.zeros(3)], chunk_bytes=16)
    for index, start, view in pieces[:5]:  # the collective got through the first five pieces, then failed
        backup.save(index, start, view)
        view.add_(100.0)
    fresh = backup.restored(parts)
    assert all(torch.equal(f, b) for f, b in zip(fresh, before))
    assert all(f.data_ptr() != p.data_ptr() for f, p in zip(fresh, parts))
    assert not torch.equal(parts[1], before[1])  # the old storage keeps what the collective wrote
