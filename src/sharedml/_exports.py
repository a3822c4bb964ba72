"""Public names listed once: a module's ``.pyi`` stub says what it exports and from where.

A public module (``sharedml``, ``sharedml.weights``, ``sharedml.measure``, ...) ships a stub of
``from sharedml.<stage>._<module> import Name as Name`` lines beside a two-line ``.py`` that
calls :func:`attach`. Type checkers and IDEs read the stub; at run time :func:`attach` reads
the same stub and loads each name on first use (PEP 562), so that ``import sharedml`` and
``sharedml --help`` import neither onnx nor onnxruntime.

scientific-python's ``lazy_loader.attach_stub`` does the same for imports *within* one
package (``from .x import y``); sharedml's public modules re-export from sibling stages
(``sharedml.measure`` from ``sharedml.inspection``), which it refuses, hence these few lines.

A loaded object whose home is a private module takes its public module's name as
``__module__`` (``sharedml`` where the top level exports it too): ``help()``, reprs, tracebacks
and pickles then name ``sharedml.SessionPool``, not the private module it happens to live in
(onnx-ir does the same).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["attach", "exported", "public_modules"]


@functools.cache
def exported(module: str) -> dict[str, tuple[str, str]]:
    """A public module's names, in its stub's order: ``{name: (home module, name there)}``."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {module}")
    stub = Path(spec.origin).with_suffix(".pyi")
    names: dict[str, tuple[str, str]] = {}
    for node in ast.parse(stub.read_text(encoding="utf-8"), str(stub)).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.asname == alias.name:  # `import X as X`: a re-export (PEP 484)
                    names[alias.name] = (node.module, alias.name)
    return names


def public_modules(module: str) -> list[str]:
    """The public submodules of ``module`` that its stub names, in the stub's order."""
    return [f"{module}.{name}" for name in _submodules(module)]


def _submodules(module: str) -> dict[str, tuple[str, str]]:
    """The public submodules a stub names (``from sharedml import weights as weights``)."""
    return {k: v for k, v in exported(module).items() if v[0] == module}


def _public_home(module: str, name: str) -> str:
    top = exported("sharedml").get(name)
    return "sharedml" if top is not None and top[0] != "sharedml" else module


def attach(
    module: str, *, fallback: Callable[[str], Any] | None = None
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for the public module named ``module``.

    Args:
        module: the public module's ``__name__``.
        fallback: called with a name the stub does not export, before AttributeError.
    """
    submodules = _submodules(module)
    names = {k: v for k, v in exported(module).items() if k not in submodules}
    namespace = importlib.import_module(module).__dict__

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{module}.{name}")  # binds it in the namespace
        where = names.get(name)
        if where is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        obj = getattr(importlib.import_module(where[0]), where[1])
        home = getattr(obj, "__module__", "") or ""
        if home.startswith("sharedml.") and any(p.startswith("_") for p in home.split(".")):
            with contextlib.suppress(AttributeError, TypeError):  # typing aliases refuse
                obj.__module__ = _public_home(module, name)
        namespace[name] = obj
        return obj

    def __dir__() -> list[str]:
        return sorted({*namespace, *names, *submodules})

    return list(names), __getattr__, __dir__
