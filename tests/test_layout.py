"""The package's layout is the pipeline: imports go down it, never sideways into private names.

The stages, lowest first. A module may import from its own stage and from stages below it; the
imports are read from the source (imports inside functions and under ``TYPE_CHECKING`` count),
so a cycle hidden in a function body fails here as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sharedml

SRC = Path(sharedml.__file__).parent

# Lowest first. The top-level `sharedml/__init__.py` (the public face) may import anything.
STAGES: list[set[str]] = [
    {"_errors", "_exports", "_host", "_units"},
    {"model"},
    {"rows"},
    {"runtime"},
    {"cache"},
    {"prepared"},
    {"weights"},
    {"route"},
    {"pool"},
    {"inspection", "measure"},
    {"protocol"},
    {"cli", "ray", "serve"},
]
LEVEL = {name: level for level, names in enumerate(STAGES) for name in names}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = ["sharedml", *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def _imports(module: str, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) for every sharedml import in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name, None) for a in node.names if a.name.startswith("sharedml")
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("sharedml"):
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:  # `from sharedml.pool import _pool`
                    found.append((node.lineno, f"{base}.{alias.name}", None))
                else:
                    found.append((node.lineno, base, alias.name))
    return found


def _edges() -> list[tuple[str, int, str, str | None]]:
    return [
        (module, line, target, name)
        for module, path in MODULES.items()
        for line, target, name in _imports(module, path)
    ]


def test_every_stage_is_a_known_subpackage() -> None:
    stages = {_stage(m) for m in MODULES} - {None}
    assert stages <= set(LEVEL), sorted(stages - set(LEVEL))


# Not the public face (sharedml, sharedml.__main__): it re-exports every stage.
@pytest.mark.parametrize("module", sorted(m for m in MODULES if _stage(m) not in (None, "_errors")))
def test_imports_go_down_the_pipeline(module: str) -> None:
    stage = _stage(module)
    assert stage is not None
    wrong = [
        f"line {line}: {target}"
        for line, target, _ in _imports(module, MODULES[module])
        if (_stage(target) is None and target != "sharedml")
        or (_stage(target) is not None and LEVEL[_stage(target) or ""] > LEVEL[stage])
    ]
    # `import sharedml` from inside the package reaches the public face, which sits on top.
    wrong += [
        f"line {line}: sharedml.{name}"
        for line, target, name in _imports(module, MODULES[module])
        if target == "sharedml"
        and name is not None
        and not name.startswith("__")
        and f"sharedml.{name}" not in MODULES
    ]
    assert not wrong, f"{module} imports upward: {wrong}"


def test_no_module_imports_another_modules_private_names() -> None:
    private = [
        f"{module}:{line} takes {name} from {target}"
        for module, line, target, name in _edges()
        if name is not None
        and name.startswith("_")
        and not name.startswith("__")
        and target != module
    ]
    assert not private, private


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, _line, target, _name in _edges():
        owner = target
        while owner not in MODULES and "." in owner:
            owner = owner.rpartition(".")[0]
        is_package = MODULES[owner].name == "__init__.py" if owner in MODULES else False
        if owner in MODULES and owner != module and not (is_package and module.startswith(owner)):
            graph[module].add(owner)
    # The top-level package and subpackage __init__ files only re-export; leave them out.
    inits = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node] - inits):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for start in sorted(set(graph) - inits):
        if start not in state:
            visit(start, [start])
    assert not cycles, cycles


def test_every_subpackage_says_its_one_job() -> None:
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            assert doc and len(doc.split()) >= 5, f"{module} has no docstring saying its job"


def test_no_test_folder_is_named_like_a_package_it_would_hide() -> None:
    # pytest puts tests/ on sys.path (for the helpers), so a folder tests/NAME imports as NAME
    # wherever the real package is missing: a tests/ray folder made `import ray` succeed without
    # Ray, and the code under test then took the folder for Ray.
    import importlib.metadata
    import sys

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    tests = Path(__file__).parent
    project = tomllib.loads((tests.parent / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        requirements += extra
    taken = {Requirement(r).name.replace("-", "_").lower() for r in requirements}
    taken |= {name.lower() for name in importlib.metadata.packages_distributions()}
    taken |= set(sys.stdlib_module_names)
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert "sharedml_ray" in folders  # the Ray deployment's tests (sharedml.ray)
    assert not folders & taken
