"""The layers point one way (style rule 17): walk every import of every package and fail on an
edge the rules below do not allow. The same rules are the README's layout table.

Run as a script to print the package import graph as a Markdown table (``docs/architecture.md``):
``.venv/bin/python tests/unit/test_layers.py``.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: package -> the packages of ours it may import. ``common`` is the shared core below every
#: process type; ``daemon`` and ``cli`` are leaves on it; ``groups`` is the communicators, below
#: the worker runtime; ``sandbox`` warms standbys with the worker's API; ``testing`` (the local
#: cluster harness of the demo, the tests and the benchmarks) sits on top.
ALLOWED: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "daemon": frozenset({"common"}),
    "cli": frozenset({"common"}),
    "groups": frozenset({"common"}),
    "worker": frozenset({"common", "groups"}),
    "sandbox": frozenset({"common", "groups", "worker"}),
    "testing": frozenset({"common", "cli"}),
}

#: single modules allowed more than their package: ``worker/launch.py`` is a training process's
#: composition root (job scripts call ``understudy.worker.launch.main``), the one place that
#: wires the standby's sandbox to the runtime. Nothing else may import it back.
EXTRA: dict[str, frozenset[str]] = {
    "worker/launch.py": frozenset({"sandbox"}),
}

#: packages that must never load torch (the daemon must not touch a GPU context; the CLI and
#: the shared core are imported by it)
NO_TORCH = ("common", "daemon", "cli")


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every absolute import in ``path``, at any depth (lazy ones too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return out


def edges() -> list[tuple[str, str, str]]:
    """``(package, imported package, "file:line")`` for each import of another package of ours."""
    found: dict[tuple[str, str, str], None] = {}  # ordered, one per statement
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, module in imports(path):
                parts = module.split(".")
                if parts[0] == "understudy" and len(parts) > 1 and parts[1] != pkg:
                    found[(pkg, parts[1], f"{rel}:{line}")] = None
    return list(found)


def test_every_package_is_in_the_rules() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert packages == set(ALLOWED), "a package without a layer rule: add it to ALLOWED"


def test_imports_point_down_the_layers_only() -> None:
    wrong = []
    for pkg, target, where in edges():
        allowed = ALLOWED[pkg] | EXTRA.get(where.split(":")[0], frozenset())
        if target not in allowed:
            wrong.append(f"{where}: {pkg} imports {target}")
    assert not wrong, "imports against the layer rules:\n" + "\n".join(sorted(set(wrong)))


def test_nothing_imports_the_composition_root() -> None:
    for pkg in ALLOWED:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "worker/launch.py":
                continue
            assert not any(m.startswith("understudy.worker.launch") for _, m in imports(path)), \
                f"{path.relative_to(ROOT)} imports worker/launch.py, the composition root"


def test_the_daemon_the_cli_and_the_core_never_import_torch() -> None:
    heavy = ("torch", "megatron", "numpy")
    wrong = [f"{path.relative_to(ROOT)}:{line}: {module}"
             for pkg in NO_TORCH for path in (ROOT / pkg).rglob("*.py")
             for line, module in imports(path) if module.split(".")[0] in heavy]
    assert not wrong, wrong


def graph_table() -> str:
    """The package graph as Markdown: rows import columns, cells count import statements."""
    counts = collections.Counter((pkg, target) for pkg, target, _ in edges())
    names = list(ALLOWED)
    rows = ["| from \\ to | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names)]
    for a in names:
        cells = ["x" if a == b else str(counts.get((a, b), "")) for b in names]
        rows.append(f"| **{a}** | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(graph_table())
