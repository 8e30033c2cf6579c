"""State transfer from a donor's memory (docs/phoenix.md), in one process: the donor and the receiver run in two
threads and the "broadcast" hands tensors from one to the other through a queue."""

from __future__ import annotations

import os
import queue
import signal
import threading

import pytest
import torch

from titan_recover.recover.phoenix.staging import HostCopies
from titan_recover.recover.phoenix.state_transfer import (
    checksum, ChecksumError, plan_ring, StateMismatch, TrainingState, transfer,
)


class Replica:
    def __init__(self, seed: int, hidden: int = 16):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.step = 0

    def state(self) -> TrainingState:
        return TrainingState([self.model], [self.optimizer], self.scheduler, train_state=self)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def train_step(self, batch: int) -> None:
        g = torch.Generator().manual_seed(batch)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1


class StagedCopies(HostCopies):
    """Every chunk through the ring (as a GPU tensor's would be), its buffers counted."""

    def __init__(self):
        self.allocated = 0

    def in_place(self, view):
        return False

    def host_buffer(self, nbytes):
        self.allocated += 1
        return super().host_buffer(nbytes)


class Deferred:
    """A GPU copy's event as the host sees it: the bytes are only there once it was waited for."""

    def __init__(self, pairs, log=None):
        self.pairs, self.log, self.done = pairs, log, False

    def synchronize(self):
        if not self.done:
            self.done = True
            for dst, src in self.pairs:
                dst.copy_(src)
            if self.log is not None:
                self.log.append("copied")


class DeferredCopies(StagedCopies):
    """Copies as a side stream makes them: nothing moves until their event is waited for (or ``join``)."""

    asynchronous = True

    def __init__(self, log=None):
        super().__init__()
        self.pending, self.log = [], log

    def copy(self, pairs):
        event = Deferred(list(pairs), self.log)
        self.pending.append(event)
        return event

    def wait_on_device(self, event):
        event.synchronize()

    def join(self):
        for event in self.pending:
            event.synchronize()


def run_transfer(donor: Replica, receiver: Replica, *, chunk_bytes: int, direct_bytes: int = 2**20, tamper=None,
                 ring: int = 4, copies=None, windows=None, digest=checksum):
    """Donor and receiver each call transfer(); returns (donor stats, receiver stats or the exception). ``copies``:
    a factory of each side's staging; ``windows``: a list that records every window each side issued, as the
    set of host storages it used."""
    pipe: queue.Queue = queue.Queue()
    results: dict[str, object] = {}

    def many(broadcast):
        if windows is None:
            return None

        def broadcast_many(tensors, on_each):
            windows.append({t.untyped_storage().data_ptr() for t in tensors})
            for i, t in enumerate(tensors):
                broadcast(t)
                on_each(i)
        return broadcast_many

    def donor_side():
        def broadcast(t):
            pipe.put(t.clone())
        results["donor"] = transfer(donor.state(), broadcast, is_donor=True, chunk_bytes=chunk_bytes,
                                    direct_bytes=direct_bytes, ring=ring, broadcast_many=many(broadcast),
                                    copies=copies() if copies else None, digest=digest)

    def receiver_side():
        count = {"n": 0}

        def broadcast(t):
            got = pipe.get(timeout=10)
            count["n"] += 1
            if tamper is not None:
                got = tamper(count["n"], got)
            t.copy_(got)
        try:
            results["receiver"] = transfer(receiver.state(), broadcast, is_donor=False, ring=ring,
                                           broadcast_many=many(broadcast), copies=copies() if copies else None,
                                           digest=digest)
        except Exception as error:  # noqa: BLE001 - handed to the test
            results["receiver"] = error

    threads = [threading.Thread(target=donor_side), threading.Thread(target=receiver_side)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive()
    return results["donor"], results["receiver"]


@pytest.mark.parametrize("direct_bytes", [2**20, 64], ids=["packed", "direct"])
def test_a_fresh_replica_becomes_bitwise_its_donor_and_stays_so(direct_bytes):
    donor, joiner = Replica(seed=0), Replica(seed=1)
    for batch in range(3):
        donor.train_step(batch)
    torch.manual_seed(99)
    donor_rng = torch.get_rng_state()

    def receiver_had_another_rng(n, t):
        if n == 1:  # the donor has built its header: now the (one-process) RNG is the joiner's own
            torch.manual_seed(1234)
        return t

    # small chunks: tensors span several
    sent, received = run_transfer(donor, joiner, chunk_bytes=100, direct_bytes=direct_bytes,
                                  tamper=receiver_had_another_rng)
    assert not isinstance(received, Exception), received
    assert sent.chunks > 10 and sent.bytes == received.bytes
    assert torch.equal(torch.get_rng_state(), donor_rng)
    assert joiner.step == 3 and joiner.scheduler.last_epoch == donor.scheduler.last_epoch
    assert joiner.optimizer.param_groups[0]["lr"] == donor.optimizer.param_groups[0]["lr"]
    for a, b in zip(donor.state().tensors(), joiner.state().tensors(), strict=True):
        assert torch.equal(a, b)
    # the next steps are identical too: the optimizer state (moments, step count) and the schedule came along
    for batch in (3, 4):
        donor.train_step(batch)
        joiner.train_step(batch)
    for a, b in zip(donor.model.parameters(), joiner.model.parameters()):
        assert torch.equal(a, b)


def test_the_saved_optimizer_state_of_equal_training_is_bitwise_equal_and_one_ulp_is_told_apart():
    """What ``--recover.save_final_parameters`` writes to ``final_optimizer/`` (final_parameters.optimizer_state)
    as the bitwise tests compare it (compare.bitwise_equal): every AdamW moment and step count by parameter
    name, the param groups, the schedule's position and rates."""
    from titan_recover.compare import bitwise_equal

    from titan_recover.recover.modes.final_parameters import optimizer_state

    a, b = Replica(seed=0), Replica(seed=0)
    for replica in (a, b):
        for batch in range(3):
            replica.train_step(batch)
    saved = optimizer_state([a.model], [a.optimizer], [a.scheduler])
    assert sorted(saved["optimizer"]) == sorted(name for name, _ in a.model.named_parameters())
    assert all(sorted(s) == ["exp_avg", "exp_avg_sq", "step"] and float(s["step"]) == 3
               for s in saved["optimizer"].values())
    assert saved["lr_schedulers"] == [{"last_epoch": 3, "base_lrs": [1e-2], "_last_lr": [1e-2 / 4]}]
    assert saved["param_groups"][0][0]["lr"] == 1e-2 / 4
    assert bitwise_equal(saved, optimizer_state([b.model], [b.optimizer], [b.scheduler]))

    moment = b.optimizer.state[b.model[0].weight]["exp_avg_sq"].view(-1)
    moment[0] = torch.nextafter(moment[0], torch.tensor(float("inf")))  # one ulp, one element
    assert not bitwise_equal(saved, optimizer_state([b.model], [b.optimizer], [b.scheduler]))
    c = Replica(seed=0)
    for batch in range(3):
        c.train_step(batch)
    c.scheduler.last_epoch += 1  # the schedule one step on, everything else equal
    assert not bitwise_equal(saved, optimizer_state([c.model], [c.optimizer], [c.scheduler]))


def test_a_replica_of_another_shape_is_refused_before_anything_is_overwritten():
    donor, other = Replica(seed=0), Replica(seed=1, hidden=32)
    donor.train_step(0)
    before = [p.detach().clone() for p in other.model.parameters()]
    _, received = run_transfer(donor, other, chunk_bytes=256)
    assert isinstance(received, StateMismatch)
    assert "same config" in str(received) and "first difference at tensor 0" in str(received)
    assert all(torch.equal(a, b) for a, b in zip(before, other.model.parameters()))


def test_pieces_cover_every_byte_once_and_large_tensors_go_as_themselves():
    from titan_recover.recover.phoenix.state_transfer import plan_pieces

    sizes = [10, 300, 5, 70]
    pieces = plan_pieces(sizes, chunk_bytes=64, direct_bytes=100)
    covered = sorted((i, o, n) for _, segments in pieces for i, o, n in segments)
    for index, size in enumerate(sizes):  # contiguous, complete, no overlap
        spans = [(o, n) for i, o, n in covered if i == index]
        assert spans[0][0] == 0 and sum(n for _, n in spans) == size
        assert all(a + m == b for (a, m), (b, _) in zip(spans, spans[1:]))
    assert all(len(segments) == 1 and segments[0][0] == 1 for direct, segments in pieces if direct)
    assert all(sum(n for *_, n in segments) <= 64 for _, segments in pieces)


def test_a_corrupted_chunk_fails_its_checksum():
    donor, joiner = Replica(seed=0), Replica(seed=1)
    donor.train_step(0)

    def flip_a_bit_of_the_third_chunk(n, t):
        # broadcasts: 1 header length, 2 header, then the chunks (the 3rd is broadcast 5), then the digests
        if n == 5:
            t = t.clone()
            t[0] ^= 1
        return t

    _, received = run_transfer(donor, joiner, chunk_bytes=128, tamper=flip_a_bit_of_the_third_chunk)
    assert isinstance(received, ChecksumError) and "chunk(s) [2]" in str(received)


def test_a_damaged_header_fails_its_checksum_and_no_metadata_is_loaded():
    """One digit of the header's JSON changed in transit (still valid JSON: a step, a rate, an RNG byte): the
    header's digest, sent with the chunks', fails the transfer before the metadata is loaded."""
    donor, joiner = Replica(seed=0), Replica(seed=1)
    donor.train_step(0)

    def change_a_digit_of_the_header(n, t):
        if n == 2:  # 1 the header's length, 2 the header
            t = t.clone()
            digit = next(i for i, b in enumerate(t.tolist()) if chr(b).isdigit())
            t[digit] = ord("7") if t[digit] != ord("7") else ord("3")
        return t

    _, received = run_transfer(donor, joiner, chunk_bytes=128, tamper=change_a_digit_of_the_header)
    assert isinstance(received, ChecksumError) and "the header (metadata)" in str(received), received
    assert "chunk(s)" not in str(received) and joiner.step == 0


def test_without_digests_the_same_bytes_arrive_and_a_flipped_bit_goes_unseen():
    """``digest=None`` (what benchmarks/state_transfer.py times to price the digests) hashes nothing: a clean
    transfer is still bitwise, and the flip the digests catch above is loaded as it came."""
    donor, joiner = Replica(seed=0), Replica(seed=1)
    donor.train_step(0)
    _, received = run_transfer(donor, joiner, chunk_bytes=128, digest=None)
    assert not isinstance(received, Exception), received
    assert all(torch.equal(a, b) for a, b in zip(donor.state().tensors(), joiner.state().tensors(), strict=True))

    def flip_a_bit_of_the_third_chunk(n, t):
        if n == 5:
            t = t.clone()
            t[0] ^= 1
        return t

    other = Replica(seed=2)
    _, received = run_transfer(donor, other, chunk_bytes=128, tamper=flip_a_bit_of_the_third_chunk,
                               digest=None)
    assert not isinstance(received, Exception), received
    assert other.step == donor.step == 1
    assert not all(torch.equal(a, b) for a, b in zip(donor.state().tensors(), other.state().tensors(), strict=True))


def test_a_digest_passed_in_sees_every_byte_once_on_each_side_and_is_what_the_receiver_checks():
    """The ``digest`` both sides compute (the benchmark's hash of a cache-resident buffer): it is given every chunk's
    bytes once per side (and the header's text), and the receiver compares its values with the donor's, so one
    that differs between the sides fails the transfer."""
    donor, joiner = Replica(seed=0), Replica(seed=1)
    donor.train_step(0)
    seen: dict[str, int] = {}

    def counting(data: torch.Tensor) -> int:
        side = threading.current_thread().name
        seen[side] = seen.get(side, 0) + data.numel()
        return 7
    stats, received = run_transfer(donor, joiner, chunk_bytes=128, digest=counting)
    assert not isinstance(received, Exception), received
    assert len(seen) == 2 and len(set(seen.values())) == 1, seen  # both sides, the same bytes
    assert stats.bytes < next(iter(seen.values())) < stats.bytes + 2**16  # every chunk once, and the header
    assert all(torch.equal(a, b) for a, b in zip(donor.state().tensors(), joiner.state().tensors(), strict=True))

    def by_side(data: torch.Tensor) -> int:
        return int("donor_side" in threading.current_thread().name)  # the thread of run_transfer's donor
    _, received = run_transfer(donor, Replica(seed=2), chunk_bytes=128, digest=by_side)
    assert isinstance(received, ChecksumError) and "chunk(s)" in str(received), received


def test_the_ring_plan_gives_every_window_at_most_ring_staged_chunks_and_reuses_the_buffers_in_turn():
    windows, slots = plan_ring([True] * 10, 4)
    assert windows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert slots == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    # chunks that travel in place (CPU slices) need no buffer and ride along with the staged ones
    windows, slots = plan_ring([False, True, False, True, True, False, False], 2)
    assert windows == [[0, 1, 2, 3], [4, 5, 6]] and slots == [None, 0, None, 1, 0, None, None]
    assert plan_ring([False, False], 3) == ([[0, 1]], [None, None])  # CPU only: one window, as before the ring
    assert plan_ring([], 3) == ([], [])


@pytest.mark.parametrize("ring", [1, 3])
@pytest.mark.parametrize("copies", [StagedCopies, DeferredCopies], ids=["at-once", "deferred"])
def test_the_ring_never_holds_more_than_its_buffers_and_every_byte_arrives(ring, copies):
    """Every chunk through the ring, as on a GPU: tensors larger than a chunk (the weights) and many small ones
    (biases, optimizer step counts); with deferred copies a missing wait would send or keep stale bytes."""
    donor, joiner = Replica(seed=0, hidden=32), Replica(seed=1, hidden=32)
    for batch in range(2):
        donor.train_step(batch)
    windows: list[set] = []
    sent, received = run_transfer(donor, joiner, chunk_bytes=256, direct_bytes=128, ring=ring, copies=copies,
                                  windows=windows)
    assert not isinstance(received, Exception), received
    assert sent.chunks > 3 * ring and sent.host_buffers == received.host_buffers == ring
    assert windows and all(len(storages) <= ring for storages in windows)  # each window's distinct host buffers
    assert len(set().union(*windows)) <= 2 * ring  # the donor's ring and the receiver's, nothing else
    assert joiner.step == donor.step == 2
    for a, b in zip(donor.state().tensors(), joiner.state().tensors(), strict=True):
        assert torch.equal(a, b)
    for batch in (2, 3):
        donor.train_step(batch)
        joiner.train_step(batch)
    assert all(torch.equal(a, b) for a, b in zip(donor.model.parameters(), joiner.model.parameters()))


def test_a_corrupted_chunk_through_the_ring_fails_and_the_metadata_stays():
    donor, joiner = Replica(seed=0), Replica(seed=1)
    donor.train_step(0)

    def flip_a_bit_of_the_fourth_chunk(n, t):
        if n == 6:  # 1 header length, 2 header, 3.. the chunks
            t = t.clone()
            t[-1] ^= 4
        return t

    _, received = run_transfer(donor, joiner, chunk_bytes=128, direct_bytes=64, ring=2, copies=DeferredCopies,
                               tamper=flip_a_bit_of_the_fourth_chunk)
    assert isinstance(received, ChecksumError) and "chunk(s) [3]" in str(received)
    assert joiner.step == 0  # the step, schedule and RNG load only after every chunk verified


def _member(port: int, replica: int, die_after_broadcasts: int | None, results) -> None:
    """One rank of each replica over a real fault-tolerant group: replica 0 donates, replica 1 joins."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from titan_recover.recover.ftpg.base import build_group, FaultDetected, FTPGConfig

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    group = build_group(FTPGConfig(), store, epoch=0, members=(0, 1), replica=replica, rank=0, timeout_s=20.0)
    me = Replica(seed=replica, hidden=256)
    if replica == 0:
        for batch in range(2):
            me.train_step(batch)
    sent = {"n": 0}

    def broadcast(t):
        if die_after_broadcasts is not None and sent["n"] == die_after_broadcasts:
            os.kill(os.getpid(), signal.SIGKILL)
        sent["n"] += 1
        group.broadcast_(t, root_replica=0)

    try:
        stats = transfer(me.state(), broadcast, is_donor=replica == 0, chunk_bytes=4096)
        digest = [float(t.double().sum()) for t in me.state().tensors()]
        results.put((replica, "done", stats.chunks, digest, me.step))
    except FaultDetected as fault:
        results.put((replica, "fault", 0, fault.reason, me.step))


def _run_pair(die_after_broadcasts: int | None):
    import multiprocessing as mp
    from datetime import timedelta

    from torch.distributed import TCPStore

    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, die_after_broadcasts if r == 0 else None, results))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        expected = 2 if die_after_broadcasts is None else 1
        got = {r: rest for r, *rest in (results.get(timeout=60) for _ in range(expected))}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got


@pytest.mark.multiprocess
def test_transfer_over_the_fault_tolerant_group():
    got = _run_pair(None)
    (donor_status, chunks, donor_digest, donor_step), (joiner_status, _, joiner_digest, joiner_step) = got[0], got[1]
    assert donor_status == joiner_status == "done" and chunks >= 5
    assert joiner_digest == donor_digest and joiner_step == donor_step == 2


@pytest.mark.multiprocess
def test_a_donor_dying_mid_transfer_is_a_fault_not_a_hang():
    got = _run_pair(die_after_broadcasts=6)  # the header went through, then some chunks
    status, _, reason, step = got[1]
    assert status == "fault" and "broadcast" in reason
    assert step == 0  # the joiner's metadata was not loaded from a partial transfer
