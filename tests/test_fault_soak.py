"""The fault soak's pure parts (benchmarks/fault_soak.py): the schedules it draws and how it judges a job."""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fault_soak as soak  # noqa: E402


def schedules(count: int, **kwargs) -> list[list[dict]]:
    settings = dict(replicas=3, ranks=2, steps=10, max_faults=3, kinds=list(soak.KINDS)) | kwargs
    return [soak.draw_schedule(random.Random(seed), **settings) for seed in range(count)]


def test_a_schedule_spares_a_replica_and_hits_a_replicas_later_starts_in_order_with_time_to_rejoin():
    drawn = schedules(200)
    assert drawn == schedules(200)  # a function of the seed
    for faults in drawn:
        assert 1 <= len(faults) <= 3
        assert len({f["replica"] for f in faults}) <= 2  # one of the three replicas is never hit
        assert faults[0]["phase"] in soak.ALWAYS and all(f["phase"] in soak.PHASES for f in faults)
        assert all(2 <= f["step"] <= 9 and 0 <= f["rank"] < 2 and f["kind"] in soak.KINDS for f in faults)
        for replica in {f["replica"] for f in faults}:
            hits = [f for f in faults if f["replica"] == replica]
            assert [f["incarnation"] for f in hits] == list(range(len(hits)))
            steps = [f["step"] for f in hits]
            assert all(later - earlier >= soak.REJOIN_STEPS for earlier, later in zip(steps, steps[1:]))
    # every replica is hit in some schedule, replica 0 (the donor while it lives) included, and every phase drawn
    assert {f["replica"] for faults in drawn for f in faults} == {0, 1, 2}
    assert {f["phase"] for faults in drawn for f in faults} == set(soak.PHASES)
    assert {f["rank"] for faults in drawn for f in faults} == {0, 1}


def test_a_coordinator_fault_lands_in_any_of_its_phases_and_leaves_the_replica_faults_as_they_were():
    args = argparse.Namespace(replicas=3, ranks=1, steps=10, max_faults=3, kinds=list(soak.KINDS))
    plain = [soak.draw(seed, argparse.Namespace(**vars(args), coordinator=False)) for seed in range(200)]
    with_it = [soak.draw(seed, argparse.Namespace(**vars(args), coordinator=True)) for seed in range(200)]
    assert plain == schedules(200, ranks=1)  # the replica faults a seed drew before the option existed
    for replica_faults, faults in zip(plain, with_it):
        *same, coordinator = faults
        assert same == replica_faults and all(f.get("process", "trainer") == "trainer" for f in same)
        assert coordinator["process"] == "coordinator" and coordinator["incarnation"] == 0
        assert coordinator["kind"] in soak.KINDS and coordinator["phase"] in soak.COORDINATOR_PHASES
        if coordinator["phase"] == "step":
            assert 2 <= coordinator["step"] <= 9
        else:  # an epoch the replica faults can form: each forms one, each admission another
            assert 1 <= coordinator["step"] <= 2 * len(same)
    drawn = [faults[-1] for faults in with_it]
    assert {f["phase"] for f in drawn} == set(soak.COORDINATOR_PHASES) and {f["kind"] for f in drawn} == set(soak.KINDS)
    assert soak.describe([drawn[0]]).startswith(f"{drawn[0]['kind']} coordinator#0 s")


def write_job(folder: pathlib.Path, losses: dict[tuple[int, int], float], state: dict[str, dict]) -> pathlib.Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"replica": replica, "step": step, soak.LOSS: loss}) + "\n"
        for (replica, step), loss in losses.items()))
    for part, sub in (("parameters", "final_parameters"), ("optimizer", "final_optimizer")):
        (folder / sub).mkdir()
        for name, saved in state.items():
            torch.save(saved[part], folder / sub / name)
    return folder


def test_a_job_passes_only_with_every_step_every_loss_and_every_saved_state_equal(tmp_path):
    weight = torch.arange(6, dtype=torch.float32)
    adam = {"optimizer": {"w": {"exp_avg": weight / 7, "step": torch.tensor(3.0)}}, "param_groups": [[{"lr": 0.1}]],
            "lr_schedulers": [{"last_epoch": 3}]}
    rank = {"parameters": {"w": weight}, "optimizer": adam}
    reference = {1: 2.5, 2: 2.25, 3: 2.0}
    states = {"replica0_rank0.pt": rank, "replica1_rank0.pt": rank}
    losses = {(r, s): loss for s, loss in reference.items() for r in (0, 1)}

    same = write_job(tmp_path / "same", losses, {"replica0_rank0.pt": rank})
    assert soak.judge(same, reference, states, steps=3) == ([], 0.0, 1)

    off = write_job(tmp_path / "off", {**losses, (1, 2): 2.25 * (1 + 2**-20)}, {"replica0_rank0.pt": rank})
    problems, max_rel, _ = soak.judge(off, reference, states, steps=3)
    assert problems == ["1 losses differ (first: replica 1 step 2)"] and 0 < max_rel < 1e-5

    short = write_job(tmp_path / "short", {k: v for k, v in losses.items() if k[1] != 3}, {"replica0_rank0.pt": rank})
    assert soak.judge(short, reference, states, steps=3)[0] == ["steps logged [1, 2]"]

    flipped = weight.clone()
    flipped[3] = torch.nextafter(flipped[3], torch.tensor(10.0))
    changed = write_job(tmp_path / "changed", losses, {"replica0_rank0.pt": {**rank, "parameters": {"w": flipped}}})
    assert soak.judge(changed, reference, states, steps=3)[0] == ["replica0_rank0.pt: parameters differ"]

    moment = {**adam, "optimizer": {"w": {"exp_avg": flipped / 7, "step": torch.tensor(3.0)}}}
    drifted = write_job(tmp_path / "drifted", losses, {"replica1_rank0.pt": {**rank, "optimizer": moment}})
    assert soak.judge(drifted, reference, states, steps=3)[0] == ["replica1_rank0.pt: optimizer differ"]
    schedule = {**adam, "lr_schedulers": [{"last_epoch": 2}]}
    behind = write_job(tmp_path / "behind", losses, {"replica1_rank0.pt": {**rank, "optimizer": schedule}})
    assert soak.judge(behind, reference, states, steps=3)[0] == ["replica1_rank0.pt: optimizer differ"]

    none = write_job(tmp_path / "none", losses, {})
    assert soak.judge(none, reference, states, steps=3)[0] == ["no final state saved"]


def test_a_restart_spent_on_anything_but_a_fault_of_the_group_fails_the_job():
    def fault(replica):
        return {"event": "fault_injected", "replica": replica, "rank": 0, "kind": "kill"}

    def asked(replica, start):
        return {"event": "join_requested", "replica": replica, "rank": 0, "incarnation": start}
    coordinator = {"event": "fault_injected", "kind": "hang", "process": "coordinator"}
    # one kill of replica 1, its one restart asked to join; replica 2 killed twice, its second start never came back
    assert soak.restarts_beyond_faults([fault(1), coordinator, asked(1, 1), fault(2), asked(2, 1), fault(2)]) == []
    # the soak's first finding: one kill of replica 1 and the coordinator hung; starts 2 and 3 asked to join
    seen = [fault(1), coordinator, asked(1, 1), asked(1, 2), asked(1, 3)]
    assert soak.restarts_beyond_faults(seen) == ["replica 1: start 3 asked to join after 1 fault(s) of its group"]


def test_a_lost_node_leaves_some_replica_no_fault_hits_and_node_0_only_on_etcd():
    args = argparse.Namespace(replicas=3, ranks=1, steps=10, max_faults=3, kinds=list(soak.KINDS), coordinator=True,
                              nodes=2, node_loss=True, store="")
    drawn = {seed: (soak.draw(seed, args), soak.draw_node_loss(seed, args, soak.draw(seed, args)))
             for seed in range(200)}
    assert soak.draw_node_loss(7, args, drawn[7][0]) == drawn[7][1]  # a function of the seed
    for faults, loss in drawn.values():
        hit = {f["replica"] for f in faults if f.get("process", "trainer") == "trainer"}
        if loss is None:  # node 1 runs group 2; with both 0 and 1 hit its loss could leave nobody
            assert hit >= {0, 1}
            continue
        assert loss["node"] == 1 and {0, 1} - hit and 2 <= loss["after_step"] <= 8
        assert 0 <= loss["replace_after_s"] <= 5 and soak.lost_groups(loss, args) == [2]
    on_etcd = argparse.Namespace(**{**vars(args), "store": "etcd://127.0.0.1:2379"})
    nodes = {soak.draw_node_loss(seed, on_etcd, faults)["node"] for seed, (faults, _) in drawn.items()
             if soak.draw_node_loss(seed, on_etcd, faults) is not None}
    assert nodes == {0, 1}
    assert soak.draw_node_loss(0, argparse.Namespace(**{**vars(args), "node_loss": False}), []) is None
    # the groups of the lost node had one start more (the replacement's), which is no restart spent
    asked = [{"event": "join_requested", "replica": 2, "rank": 0, "incarnation": 1}]
    assert soak.restarts_beyond_faults(asked, lost=[2]) == []
    assert soak.restarts_beyond_faults(asked) == ["replica 2: start 1 asked to join after 0 fault(s) of its group"]


def test_the_summary_counts_what_fired_by_kind_phase_and_rank_and_replica_0s_hits():
    text = ("seed 1 [...]: fired 2 [kill r0.1 s3 commit, hang r2.0 s5 transfer], admitted [(0, 4)], 3 final states\n"
            "seed 2 [...]: fired 1 [kill r0.0 s2 forward], admitted [], 2 final states\n"
            "seed 3 [...]: fired 0 [], admitted [], 3 final states\n"
            "seed 4 [...]: fired 1 [raise coordinator s2 publish], admitted [], 3 final states\n")
    assert soak.summarise(text) == ("kind_hang=1 kind_kill=2 kind_raise=1 phase_commit=1 phase_forward=1 "
                                    "phase_publish=1 phase_transfer=1 rank_0=2 rank_1=1 rank_coordinator=1 "
                                    "replica0_hits=2 jobs_with_replica0_hit=2")
