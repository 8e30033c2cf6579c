"""A real-text English corpus present on every machine that has Python: the interpreter's own documentation.

Two sources, both shipped with CPython and read in a fixed order, so the corpus is byte-identical on every machine
with the same Python version (the version is recorded in the prepared data's ``meta.json``):

* ``pydoc_data.topics``: the language reference and library topics that ``help()`` shows (~0.5 MB of prose);
* the docstrings of the standard library's modules, classes and functions (~1.5 MB), one document per module.

A user's own data goes through :func:`iter_user_documents` instead (``.txt``: one document per file;
``.jsonl``: one document per line, from the ``text`` field).
"""

from __future__ import annotations

import ast
import json
import pathlib
import sysconfig
from collections.abc import Iterator

# Stdlib folders left out: tests (code, not prose) and third-party packages.
_SKIP_TOP = frozenset({"site-packages", "dist-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo"})


def iter_python_docs() -> Iterator[str]:
    """Yield the default corpus's documents in a deterministic order."""
    import pydoc_data.topics

    for name in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[name].strip()
        if text:
            yield text

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in _SKIP_TOP or "tests" in parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [
            doc
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (doc := ast.get_docstring(node))
        ]
        if docs:
            yield "\n\n".join(docs)


def iter_user_documents(paths: list[str], text_field: str = "text") -> Iterator[str]:
    """Yield documents from a user's ``.txt`` / ``.jsonl`` files (folders are searched recursively, sorted)."""
    files: list[pathlib.Path] = []
    for raw in paths:
        p = pathlib.Path(raw)
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl", ".json")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"data input {raw!r} does not exist")
    if not files:
        raise ValueError(f"no .txt or .jsonl files found in {paths}")
    for f in files:
        if f.suffix in (".jsonl", ".json"):
            with f.open(encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if text_field not in record:
                        raise ValueError(f"{f}:{lineno}: no {text_field!r} field (fields: {sorted(record)})")
                    if record[text_field].strip():
                        yield record[text_field]
        else:
            text = f.read_text(encoding="utf-8").strip()
            if text:
                yield text
