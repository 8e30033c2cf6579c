"""Prepare a dataset: corpus -> BPE tokenizer (``tokenizers``) -> one memory-mapped token file.

Usage::

    python -m titan_recover.data.prepare                       # default corpus into data/python_docs
    python -m titan_recover.data.prepare --input my_texts/ --out data/mine --vocab-size 32000

Output folder (also a valid TorchTitan ``hf_assets_path``)::

    tokenizer.json, tokenizer_config.json   the trained BPE tokenizer
    tokens.bin                              all documents' ids, each as <bos> ... <eos>, little-endian
    meta.json                               dtype, counts, special ids, sources, sha256 of tokens.bin

Deterministic: the same inputs and options give byte-identical files (a test checks it). The folder is written
under a temporary name and renamed into place, so an interrupted run never leaves a half-written dataset and
never replaces a good one; several launchers preparing the same folder at once (one per node, on a shared file
system) keep the first complete one and discard the others' identical copies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile

import numpy as np

from titan_recover.data.corpus import iter_python_docs, iter_user_documents

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
FORMAT_VERSION = 1
DEFAULT_DATA_DIR = "data/python_docs"


def train_tokenizer(documents: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def prepare(out: str, inputs: list[str] | None = None, vocab_size: int = 2048, force: bool = False) -> pathlib.Path:
    """Build the dataset folder ``out``; returns its path. Skips the work if ``out`` is already complete."""
    out_path = pathlib.Path(out)
    if (out_path / "meta.json").exists() and not force:
        return out_path
    if vocab_size < 260:
        raise ValueError(f"--vocab-size must be at least 260 (256 bytes + specials), got {vocab_size}")

    documents = list(iter_user_documents(inputs) if inputs else iter_python_docs())
    tokenizer = train_tokenizer(documents, vocab_size)
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    dtype = np.dtype("<u2" if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max else "<u4")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False}, indent=2) + "\n"
        )
        digest = hashlib.sha256()
        n_tokens = 0
        with open(tmp / "tokens.bin", "wb") as fh:
            for start in range(0, len(documents), 512):
                for enc in tokenizer.encode_batch(documents[start : start + 512], add_special_tokens=False):
                    ids = np.asarray([bos_id, *enc.ids, eos_id], dtype=dtype)
                    raw = ids.tobytes()
                    fh.write(raw)
                    digest.update(raw)
                    n_tokens += len(ids)
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype.str,
            "n_tokens": n_tokens,
            "n_documents": len(documents),
            "vocab_size": tokenizer.get_vocab_size(),
            "bos_id": bos_id,
            "eos_id": eos_id,
            "sources": inputs or [f"python {platform.python_version()} documentation (pydoc topics + stdlib docstrings)"],
            "tokens_sha256": digest.hexdigest(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out_path.exists() and (force or not (out_path / "meta.json").exists()):
            shutil.rmtree(out_path)  # a rebuild asked for, or a folder that is not a dataset of ours
        try:
            os.replace(tmp, out_path)
        except OSError:  # a complete folder appeared meanwhile: another launcher (another node) built it first
            if force or not (out_path / "meta.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # the same bytes (deterministic); theirs may be in use already
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_DATA_DIR, help="output folder (default: %(default)s)")
    parser.add_argument("--input", action="append", help=".txt/.jsonl file or folder; repeatable. Default: Python docs")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    path = prepare(args.out, args.input, args.vocab_size, args.force)
    meta = json.loads((path / "meta.json").read_text())
    print(f"{path}: {meta['n_tokens']:,} tokens, {meta['n_documents']:,} documents, vocab {meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
