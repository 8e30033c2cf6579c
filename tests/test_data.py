"""Data preparation and O(1) addressable microbatches (no processes but one: the corpus built again)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from titan_recover.data.addressable import AddressableTokens
from titan_recover.data.prepare import prepare


def _digest(folder: pathlib.Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in ("tokens.bin", "tokenizer.json", "meta.json")
    }


def test_default_corpus_is_real_text(default_data):
    meta = json.loads((default_data / "meta.json").read_text())
    assert meta["n_tokens"] > 300_000 and meta["n_documents"] > 100

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_data / "tokenizer.json"))
    ids = np.fromfile(default_data / "tokens.bin", dtype=meta["dtype"], count=4000)
    text = tok.decode(ids.tolist())
    assert " the " in text and "function" in text  # English prose about Python
    assert tok.encode("The quick brown fox.").tokens  # a working BPE tokenizer


@pytest.mark.multiprocess
def test_the_default_corpus_built_by_another_process_is_the_same_bytes(default_data, tmp_path):
    """The whole preparation again, as another machine with the same Python runs it: a process of its own (its own
    hash seed: an order that followed one would show), from the stdlib's files to the token file."""
    proc = subprocess.run([sys.executable, "-m", "titan_recover.data.prepare", "--out", str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _digest(tmp_path / "again") == _digest(default_data)


def test_user_jsonl_and_text_inputs(tmp_path):
    docs = [{"text": f"Document number {i} talks about replicas and recovery. " * 5} for i in range(40)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (tmp_path / "in" / "b.txt").write_text("A plain text file is one document.\n" * 20)
    out = prepare(str(tmp_path / "out"), [str(tmp_path / "in")], vocab_size=300)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_documents"] == 41 and meta["vocab_size"] <= 300
    tokens = np.fromfile(out / "tokens.bin", dtype=meta["dtype"])
    assert int((tokens == meta["eos_id"]).sum()) == 41 and tokens[0] == meta["bos_id"]

    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no 'text' field"):
        prepare(str(tmp_path / "bad_out"), [str(tmp_path / "bad.jsonl")], vocab_size=300)
    assert not (tmp_path / "bad_out").exists()  # a failed preparation leaves nothing behind


def test_launchers_preparing_the_same_folder_at_once_keep_the_first_complete_one(tmp_path, monkeypatch):
    """One launcher per node prepares the default data on a shared file system: a launcher that finishes second
    neither fails nor replaces the folder the first one's ranks may already read."""
    import titan_recover.data.prepare as prepare_module

    (tmp_path / "in.txt").write_text("Every node builds the same dataset from the same documents.\n" * 20)
    out, train = tmp_path / "out", prepare_module.train_tokenizer

    def another_launcher_finishes_first(documents, vocab_size):
        monkeypatch.setattr(prepare_module, "train_tokenizer", train)
        prepare(str(out), [str(tmp_path / "in.txt")], vocab_size=300)  # the other node's launcher, meanwhile
        (out / "in_use").write_text("")  # its ranks read this folder now
        return train(documents, vocab_size)

    monkeypatch.setattr(prepare_module, "train_tokenizer", another_launcher_finishes_first)
    assert prepare(str(out), [str(tmp_path / "in.txt")], vocab_size=300) == out
    assert (out / "in_use").exists() and (out / "meta.json").exists()  # the first complete folder, kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out"]  # the second copy discarded
    (out / "meta.json").unlink()  # a folder that is not a complete dataset is still replaced
    assert json.loads((prepare(str(out), [str(tmp_path / "in.txt")], vocab_size=300) / "meta.json").read_text())
    assert not (out / "in_use").exists()


def test_microbatch_is_a_pure_function_of_its_address(default_data):
    a = AddressableTokens(default_data, seq_len=32, seed=3)
    b = AddressableTokens(default_data, seq_len=32, seed=3)  # "another process"
    for g, s in [(0, 0), (17, 1), (10_000, 3), (5, 2)]:  # any order, any id
        x_in, x_lab = a.microbatch(g, s, shard_degree=4, batch_size=2)
        y_in, y_lab = b.microbatch(g, s, shard_degree=4, batch_size=2)
        assert torch.equal(x_in["input"], y_in["input"]) and torch.equal(x_lab, y_lab)
        assert torch.equal(x_in["input"][:, 1:], x_lab[:, :-1])  # labels are inputs shifted by one
    # distinct addresses read distinct windows within an epoch
    windows = {a.window(i) for i in range(a.n_windows)}
    assert len(windows) == a.n_windows
    # a replica microbatch is its shards' rows side by side
    full = a.rows(7 * 4 * 2, 8)[1]
    parts = torch.cat([a.microbatch(7, s, shard_degree=4, batch_size=2)[1] for s in range(4)])
    assert torch.equal(full, parts)


def test_document_positions_restart_after_eos(default_data):
    tokens = AddressableTokens(default_data, seq_len=8)
    eos = tokens.meta.eos_id
    inputs = np.array([[5, 6, eos, 7, 8, 9, eos, 4], [eos, 11, 12, 13, 14, 15, 16, 17]])
    assert tokens.document_positions(inputs).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_loader_iteration_matches_addresses_and_resumes(default_data):
    from titan_recover.data.loader import AddressableDataLoader

    def build(rank):
        cfg = AddressableDataLoader.Config(dataset_path=str(default_data))
        return cfg.build(dp_world_size=2, dp_rank=rank, seq_len=16, local_batch_size=2)

    loader = build(1)
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    for c, (inp, lab) in enumerate(seen):  # n = c * dp + rank
        ref_in, ref_lab = loader.local_batch(c * 2 + 1)
        assert torch.equal(inp["input"], ref_in["input"]) and torch.equal(lab, ref_lab)
    state = loader.state_dict()
    following = next(it)
    resumed = build(1)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))[1], following[1])


def test_missing_data_folder_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m titan_recover.data.prepare --out"):
        AddressableTokens(tmp_path / "nothing", seq_len=8)
