"""The layout's rules (docs/architecture.md), read from the source: who may import whom, and function length."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "titan_recover"
COMPONENTS = ("invariant", "phoenix", "scout", "diloco", "chaos")
BELOW = ("groups", "ftpg", "stores")
ABOVE = ("trainer", "job_config", "launch", "train")


def imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """``(module, at_top_level)`` of every ``titan_recover`` import in ``path``; imports under
    ``if TYPE_CHECKING:`` count as not at top level (they never run)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titan_recover"):
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("titan_recover")]
        else:
            continue
        top = node.col_offset == 0 and id(node) not in typing_only
        found += [(name, top) for name in names]
    return found


def package_of(module: str) -> tuple[str, ...]:
    return tuple(module.split(".")[1:])


def modules(*where: str) -> list[pathlib.Path]:
    return sorted(ROOT.joinpath(*where).rglob("*.py"))


def test_components_import_nothing_above_them():
    """A component never imports a mode, the trainer or an entry point; the layer below the components (groups,
    ftpg, stores) imports no component, and names the [recover] section only as a type; config/ never imports the
    trainer or the resilience layer."""
    wrong = []
    for pkg in (*COMPONENTS, *BELOW):
        for path in modules("recover", pkg):
            for module, top in imports(path):
                target = package_of(module)
                if target[:2] == ("recover", "modes") or (target[:1] and target[0] in ABOVE and top):
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
                if pkg in BELOW and target[:1] == ("recover",) and len(target) > 1 and target[1] in COMPONENTS:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
                if pkg in BELOW and target == ("recover", "config") and top:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module} at run time")
    for path in modules("config"):
        for module, _ in imports(path):
            if package_of(module)[:1] in (("trainer",), ("job_config",), ("recover",)):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == []


def test_only_the_trainer_imports_a_mode():
    importers = set()
    for path in sorted(ROOT.rglob("*.py")):
        if path.is_relative_to(ROOT / "recover" / "modes"):
            continue
        if any(package_of(m)[:2] == ("recover", "modes") for m, _ in imports(path)):
            importers.add(str(path.relative_to(ROOT)))
    assert importers == {"trainer.py"}


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def _imports_torchtitan(node: ast.stmt) -> bool:
    return (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan")) or (
        isinstance(node, ast.Import) and any(a.name.startswith("torchtitan") for a in node.names))


def _activates_platform(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, ast.Expr) else getattr(node, "value", None)
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "activate" \
        and getattr(call.func.value, "id", "") == "platform"


def test_every_module_importing_torchtitan_activates_the_platform_first():
    """TorchTitan's trainer, metrics, parallel-dims and distributed-utils modules copy its device globals when
    imported, so :func:`titan_recover.platform.activate` must run before them: a module imported first that brought
    one in unactivated would make ``build_config`` refuse to run on CPU. The rule, read from the source: a module
    that imports TorchTitan at top level calls ``platform.activate()`` before its first such import."""
    activating, late = [], []
    for path in sorted(ROOT.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        first = next((i for i, node in enumerate(body) if _imports_torchtitan(node)), None)
        if first is not None:
            name = str(path.relative_to(ROOT))
            (activating if any(map(_activates_platform, body[:first])) else late).append(name)
    assert "trainer.py" in activating and "metrics.py" in activating
    assert late == []
