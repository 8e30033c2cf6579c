"""Who writes a stop's checkpoint, in turn (``recover/groups/stop_checkpoint.py``): the pure turns over a store,
with a scripted clock; the handover end to end is ``tests/test_replica_groups.py``'s too-few-replicas stop."""

from __future__ import annotations

from torch.distributed import HashStore

from titan_recover.recover.groups.keys import GroupKeys
from titan_recover.recover.groups.stop_checkpoint import StopCheckpoint


class Script:
    """A clock advanced by each sleep; ``at[t]`` runs once the clock reaches ``t``."""

    def __init__(self, at: dict[float, object] | None = None):
        self.now, self.at = 0.0, dict(at or {})

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert self.now < 600, "the wait never ended"
        self.now += seconds
        for t in sorted(t for t in self.at if t <= self.now):
            self.at.pop(t)()


def turns(store, replica, script, rank=0, candidates=(0, 1, 2), stall_timeout_s=10.0):
    return StopCheckpoint(store, step=7, candidates=candidates, replica=replica, rank=rank,
                          stall_timeout_s=stall_timeout_s, poll_s=0.1, clock=script.clock, sleep=script.sleep)


def beating(store, replica):
    """The replica's group beat, rewritten with a new value at each call (its leader alive)."""
    count = [0]

    def beat():
        count[0] += 1
        store.set(GroupKeys.heartbeat(replica), f"beat {count[0]}")
    return beat


def test_the_first_candidate_writes_and_the_others_learn_it_saved():
    store, script = HashStore(), Script()
    writer = turns(store, 0, script)
    assert writer.mine and writer.writer == 0
    script.at[1.0] = lambda: writer.report(saved=True)
    waiting = turns(store, 2, script)
    turn = waiting.await_turn()
    assert not turn.mine and turn.written_by == 0 and waiting.last == turn and not turn.reason
    assert store.get(GroupKeys.stop_checkpoint(7, 0)) == b"saved"


def test_a_writer_the_coordinator_names_lost_passes_its_turn_to_the_next_candidate():
    store, script = HashStore(), Script()
    store.set(GroupKeys.heartbeat(0), "its last beat")
    script.at[1.0] = lambda: store.set(GroupKeys.stop_lost(0), "1")
    second, third = turns(store, 1, script), turns(store, 2, script)
    turn = second.await_turn()
    assert turn.mine and second.round == 1 and second.handovers == [(0, "lost")]
    assert store.get(GroupKeys.stop_checkpoint(7, 0)) == b"lost"
    assert second.report(saved=True) == "saved"
    turn = third.await_turn()  # reads the same sequence: replica 0 lost, replica 1 saved
    assert not turn.mine and turn.written_by == 1 and third.handovers == [(0, "lost")]


def test_a_failed_save_passes_the_turn_on_and_every_rank_of_the_next_group_takes_it():
    store, script = HashStore(), Script()
    first = turns(store, 0, script)
    assert first.report(saved=False) == "failed"
    ranks = [turns(store, 1, script, rank=r) for r in (0, 1)]
    assert all(t.await_turn().mine for t in ranks) and [t.handovers for t in ranks] == [[(0, "failed")]] * 2
    assert ranks[1].report(saved=True) == "saved"  # a rank other than 0 reports nothing
    assert not store.check([GroupKeys.stop_checkpoint(7, 1)])


def test_a_writer_that_keeps_beating_is_waited_for_as_long_as_its_save_takes():
    """The wait follows progress: 30 s of save with a beat every second is 3 times the stall bound."""
    store, script = HashStore(), Script()
    beat = beating(store, 0)
    for t in range(31):
        script.at[float(t)] = beat
    writer = turns(store, 0, script)
    script.at[30.5] = lambda: writer.report(saved=True)
    turn = turns(store, 1, script, stall_timeout_s=10.0).await_turn()
    assert not turn.mine and turn.written_by == 0 and script.now >= 30.5


def test_a_writer_whose_beat_stands_still_with_no_coordinator_to_name_it_ends_the_wait_with_a_sentence():
    store, script = HashStore(), Script()
    store.set(GroupKeys.heartbeat(0), "its last beat")
    waiting = turns(store, 1, script, stall_timeout_s=10.0)
    turn = waiting.await_turn()
    assert not turn.mine and turn.written_by is None and 10.0 < script.now < 11.0
    assert "has not beaten for 10 s and no coordinator named it lost: the coordinator is gone too" in turn.reason
    assert waiting.last == turn


def test_when_every_candidate_lost_its_turn_nobody_writes():
    store, script = HashStore(), Script()
    store.set(GroupKeys.stop_checkpoint(7, 0), "lost")
    store.set(GroupKeys.stop_checkpoint(7, 1), "failed")
    turn = turns(store, 3, script, candidates=(0, 1)).await_turn()  # a survivor that is no candidate
    assert not turn.mine and turn.written_by is None
    assert "(replica 0 lost, replica 1 failed): no checkpoint written" in turn.reason


def test_a_writer_named_lost_before_it_reports_learns_that_its_save_does_not_count():
    store, script = HashStore(), Script()
    writer = turns(store, 0, script)
    store.compare_set(GroupKeys.stop_checkpoint(7, 0), "", "lost")  # a waiting rank gave up on it first
    assert writer.report(saved=True) == "lost"
