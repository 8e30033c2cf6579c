"""One launcher per node (docs/deploy.md "Running on many nodes"), without processes: which replica groups a node
runs, the launcher's multi-node options, the nodes' config agreement, and the job's store URL."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch  # noqa: F401 (imported before the launcher fixture forbids processes: its first import may run ldconfig)
from torch.distributed import TCPStore

from conftest import free_port
from titan_recover.config.apply import ConfigError
from titan_recover.config.render import render_toml
from titan_recover.job_config import build_config
from titan_recover.recover.job_store import agree_config, ConfigMismatch, join_embedded, NoJobStore, publish_config
from titan_recover.recover.nodes import agreed_text, first_difference, node_groups, NodeKeys, parse_endpoint
from titan_recover.recover.stores import job_url

REPLICAS = "train_configs/replicas.toml"


def test_each_node_runs_a_contiguous_block_of_the_groups_the_first_ones_one_more():
    assert [node_groups(3, 2, r) for r in range(2)] == [range(0, 2), range(2, 3)]
    assert [list(node_groups(7, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [node_groups(4, 4, r) for r in range(4)] == [range(r, r + 1) for r in range(4)]
    assert node_groups(5, 1, 0) == range(5)
    for groups in range(1, 12):  # every group on exactly one node, sizes differ by at most one
        for nnodes in range(1, groups + 1):
            blocks = [node_groups(groups, nnodes, r) for r in range(nnodes)]
            assert [g for b in blocks for g in b] == list(range(groups))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_more_nodes_than_groups_or_a_rank_outside_the_job_is_refused_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"--nnodes 4 is more than the job's 3 replica groups .* 1 node\(s\) would "
                                         r"have nothing to run; use at most 3 nodes"):
        node_groups(3, 4, 0)
    with pytest.raises(ValueError, match=r"--node-rank 2 is not a rank of --nnodes 2 \(0 ... 1\)"):
        node_groups(3, 2, 2)


def test_rdzv_endpoints():
    assert parse_endpoint("node0:29400") == ("node0", 29400)
    assert parse_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("node0", "node0:", ":29400", "node0:0", "node0:http"):
        with pytest.raises(ValueError, match="--rdzv-endpoint must be HOST:PORT"):
            parse_endpoint(bad)


def test_the_first_difference_of_two_configs_names_its_section_and_key():
    ours = "[job]\ndump_folder = \"x\"\n\n[training]\nsteps = 8\nseq_len = 256\n"
    assert first_difference(ours, ours) is None
    assert first_difference(ours, ours.replace("steps = 8", "steps = 9")) == (
        "[training] steps: node 0 has 'steps = 8', this node has 'steps = 9'")
    assert "(nothing)" in first_difference(ours, ours + "[extra]\n")


def test_the_launchers_multi_node_options_are_checked_before_any_process(launcher):
    base = (REPLICAS, "--recover.replicas", "3", "--dry-run")
    code, _, err = launcher(*base, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400")
    assert code == 2 and "needs --node-rank R (0 ... 1)" in err, err
    code, _, err = launcher(*base, "--nnodes", "2", "--node-rank", "1")
    assert code == 2 and "needs --rdzv-endpoint HOST:PORT: where node 0's launcher hosts the job's store" in err, err
    code, _, err = launcher(*base, "--nnodes", "4", "--node-rank", "0", "--rdzv-endpoint", "n0:29400")
    assert code == 2 and "--nnodes 4 is more than the job's 3 replica groups" in err, err
    code, _, err = launcher(*base, "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "n0:29400")
    assert code == 2 and "--node-rank 2 is not a rank of --nnodes 2" in err, err
    code, _, err = launcher(*base, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "n0")
    assert code == 2 and "--rdzv-endpoint must be HOST:PORT" in err, err
    code, _, err = launcher(*base, "--nnodes", "two")
    assert code == 2 and "--nnodes must be an integer, got 'two'" in err, err
    code, out, err = launcher(*base, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "n0:29400")
    assert code == 0, err
    assert "node 0 of 2: replica groups 0-1; hosts the job's store and runs the coordinator" in out
    code, out, err = launcher(*base, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "n0:29400")
    assert code == 0 and "node 1 of 2: replica group 2" in out, err
    code, out, err = launcher(REPLICAS, "--recover.mode", "diloco", "--nnodes", "2", "--node-rank", "0",
                              "--rdzv-endpoint", "n0:29400", "--dry-run")
    assert code == 0 and "hosts the job's store and runs the coordinator and the syncer" in out, err
    code, out, err = launcher(REPLICAS, "--recover.mode", "diloco", "--recover.store", "etcd://e1:2379", "--nnodes",
                              "2", "--node-rank", "1", "--dry-run")
    assert code == 0 and "node 1 of 2: replica group 1; runs a standby coordinator and a standby syncer" in out, err
    code, out, err = launcher("--help")
    assert code == 0 and "where\n                          node 0's launcher hosts the job's store" in out


def test_store_urls_are_checked_with_the_config(launcher):
    code, _, err = launcher(REPLICAS, "--recover.store", "etcd://", "--dry-run")
    assert code == 2 and "recover.store: store URL 'etcd://': an empty HOST:PORT; accepted forms:" in err, err
    code, _, err = launcher(REPLICAS, "--recover.store", "node0:29400", "--dry-run")
    assert code == 2 and "the TCPStore is embedded in the launcher, not named here" in err, err
    code, out, err = launcher(REPLICAS, "--recover.store", "etcd://e1:2379,e2:2379/jobs", "--recover.replicas", "3",
                              "--nnodes", "3", "--node-rank", "2", "--dry-run")
    assert code == 0 and "node 2 of 3: replica group 2" in out, err  # no --rdzv-endpoint needed with etcd
    assert job_url("etcd://e1:2379,[::1]:2379/jobs", "my run", "t-1") == "etcd://e1:2379,[::1]:2379/jobs/my_run/t-1"
    assert job_url("etcd://e1:2379", "run") == "etcd://e1:2379/titan_recover/run"


def test_a_node_whose_config_differs_from_node_0s_is_refused_before_it_starts_anything(launcher, tmp_path):
    """Node 0's store (hosted here) holds its resolved config; node 1's launcher resolves another number of steps:
    exit 2, the first differing key named, no process started."""
    args = [REPLICAS, "--model.flavor", "tiny", "--recover.replicas", "3", "--dump_folder", str(tmp_path)]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    publish_config(store, agreed_text(render_toml(build_config(args[0], args[1:] + ["--training.steps", "8"])), 2),
                   "0")
    node1 = ("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{store.port}")
    code, _, err = launcher(*args, "--training.steps", "9", *node1)
    assert code == 2, err
    assert ("config error: this node's resolved config differs from node 0's" in err and
            "[training] steps: node 0 has 'steps = 8', this node has 'steps = 9'" in err), err


def test_a_node_whose_replica_groups_have_another_process_count_is_refused(launcher, tmp_path):
    """The same config, but node 0's groups have 4 processes (its --nproc-per-node, or its GPUs) and node 1's
    2: groups of different sizes could never reduce together, so node 1 refuses before it starts anything."""
    args = [REPLICAS, "--model.flavor", "tiny", "--recover.replicas", "3", "--dump_folder", str(tmp_path)]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    publish_config(store, agreed_text(render_toml(build_config(args[0], args[1:])), 4), "0")
    code, _, err = launcher(*args, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{store.port}")
    assert code == 2 and "processes per replica group: node 0 has" in err and "= 4'" in err and "= 2'" in err, err


def test_agreeing_nodes_adopt_node_0s_start_and_a_missing_store_is_a_clear_error():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    publish_config(store, "[training]\nsteps = 8\n", "1234.5")
    assert agree_config(store, "[training]\nsteps = 8\n", wait_s=1) == "1234.5"
    with pytest.raises(ConfigMismatch, match=r"\[training\] steps"):
        agree_config(store, "[training]\nsteps = 7\n", wait_s=1)
    assert store.check([NodeKeys.CONFIG, NodeKeys.START])
    port = free_port()
    started = time.monotonic()
    with pytest.raises(NoJobStore, match=rf"no job store at 127.0.0.1:{port} after 0.5 s: is node 0's launcher "
                                         "running"):
        join_embedded("127.0.0.1", port, wait_s=0.5, timeout_s=10)
    assert time.monotonic() - started < 10


def test_config_rejects_bad_store_urls():
    with pytest.raises(ConfigError, match=r"recover.store: store URL 'etcd://e1:2379//x': an empty segment"):
        build_config(None, ["--recover.store", "etcd://e1:2379//x"])
    assert build_config(None, ["--recover.store", "etcd://e1:2379"]).recover.store == "etcd://e1:2379"


def test_a_server_advertised_to_other_nodes_at_a_loopback_name_is_warned_about_and_the_node_address_wins():
    """A snapshot keeper or a standby syncer advertised at a name that resolves to loopback here (a hostname mapped
    to Debian's 127.0.1.1) cannot be reached from other machines: the launcher warns, naming the variable that
    sets the node's address; several "nodes" on one machine (the tests) still work, hence not an error."""
    from titan_recover.recover.nodes import is_loopback, node_address, NODE_ADDRESS_ENV, unreachable

    assert is_loopback("127.0.0.1") and is_loopback("127.0.1.1") and is_loopback("::1")
    assert not is_loopback("10.1.2.3") and not is_loopback("no-such-host.invalid")
    assert NODE_ADDRESS_ENV in unreachable("this node's snapshot keeper", "127.0.1.1")
    assert unreachable("this node's snapshot keeper", "10.1.2.3") is None
    assert node_address(lambda: "localhost", environ={NODE_ADDRESS_ENV: "10.1.2.3"}) == "10.1.2.3"
    assert node_address(lambda: "node7.cluster", environ={}) == "node7.cluster"
