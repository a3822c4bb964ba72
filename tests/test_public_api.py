"""The public surface: exactly what `sharedml.__all__` promises, and nothing private leaks in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import sharedml


def test_all_names_exist_and_are_unique() -> None:
    assert len(sharedml.__all__) == len(set(sharedml.__all__))
    for name in sharedml.__all__:
        assert hasattr(sharedml, name), name


def test_every_public_object_is_exported() -> None:
    for name in sharedml.__all__:  # loaded on first use (PEP 562): load them all
        getattr(sharedml, name)
    public = {
        name
        for name, value in vars(sharedml).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }
    assert public == set(sharedml.__all__) - {"__version__"}


def test_every_error_is_a_sharedml_error() -> None:
    errors = [getattr(sharedml, n) for n in sharedml.__all__ if n.endswith(("Error", "Timeout"))]
    assert errors
    for cls in errors:
        assert issubclass(cls, sharedml.SharedMLError)
    assert issubclass(sharedml.PoolTimeout, TimeoutError)
    assert issubclass(sharedml.PoolClosedError, RuntimeError)
    assert issubclass(sharedml.ModelNotFoundError, FileNotFoundError)
    assert issubclass(sharedml.UnsafePathError, PermissionError)
    assert issubclass(sharedml.OutputError, OSError)
    assert issubclass(sharedml.OutputError, sharedml.PrepareError)


def test_public_objects_name_sharedml_as_their_module() -> None:
    for name in sharedml.__all__:
        obj = getattr(sharedml, name)
        if isinstance(obj, (type, types.FunctionType)):
            assert obj.__module__ == "sharedml", name
    assert repr(sharedml.SessionPool).startswith("<class 'sharedml.SessionPool'")


def _annotations_of(obj: object) -> list[str]:
    if isinstance(obj, type):
        hints = [str(a) for a in getattr(obj, "__annotations__", {}).values()]
        init = obj.__dict__.get("__init__")
        if init is not None:
            hints += [str(a) for a in getattr(init, "__annotations__", {}).values()]
        for member in vars(obj).values():
            if isinstance(member, property) and member.fget is not None:
                hints += [str(a) for a in member.fget.__annotations__.values()]
            elif isinstance(member, (types.FunctionType, classmethod, staticmethod)):
                func = getattr(member, "__func__", member)
                if not func.__name__.startswith("_"):
                    hints += [str(a) for a in func.__annotations__.values()]
        return hints
    return [str(a) for a in getattr(obj, "__annotations__", {}).values()]


def _private_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "sharedml" and any(p.startswith("_") for p in parts[1:])


def test_every_sharedml_type_a_public_signature_names_is_exported() -> None:
    missing = set()
    for name in sharedml.__all__:
        obj = getattr(sharedml, name)
        for hint in _annotations_of(obj):
            for ident in re.findall(r"[A-Z][A-Za-z0-9_]+", hint):
                for module in [m for n, m in sys.modules.items() if _private_module(n)]:
                    value = getattr(module, ident, None)
                    ours = isinstance(value, type) and value.__module__.startswith("sharedml")
                    if ours and ident not in sharedml.__all__:
                        missing.add(f"{name} -> {ident}")
    assert not missing, sorted(missing)


def test_help_and_version_import_neither_onnx_nor_onnxruntime() -> None:
    code = (
        "import sys\n"
        "from sharedml.cli import main\n"
        "for argv in (['--help'], ['--version'], ['inspect', '--help'], ['cache', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('onnx', 'onnxruntime', 'numpy') if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "HEAVY []" in out.stderr, out.stderr[-2000:]


def test_the_public_names_load_lazily_and_still_name_sharedml() -> None:
    code = (
        "import sys, sharedml\n"
        "assert 'onnxruntime' not in sys.modules and 'onnx' not in sys.modules\n"
        "from sharedml import SessionPool, PoolTimeout\n"
        "assert SessionPool.__module__ == 'sharedml' and PoolTimeout.__module__ == 'sharedml'\n"
        "assert 'SessionPool' in dir(sharedml)\n"
        "try:\n"
        "    sharedml.NoSuchThing\n"
        "except AttributeError as exc:\n"
        "    assert 'NoSuchThing' in str(exc)\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "OK", out.stderr[-2000:]


def test_a_clone_named_sharedml_does_not_shadow_the_installed_package(tmp_path: Path) -> None:
    clone = tmp_path / "sharedml"  # as `git clone ... sharedml` leaves it: no __init__.py
    (clone / "tests").mkdir(parents=True)
    (clone / "README.md").write_text("a checkout")
    out = subprocess.run(
        [sys.executable, "-c", "import sharedml; print(sharedml.SessionPool.__name__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert out.returncode == 0 and out.stdout.strip() == "SessionPool", out.stderr[-2000:]


def test_ray_stays_optional() -> None:
    """`pip install .` never pulls Ray; importing sharedml (or sharedml.ray) never imports it."""
    import importlib.metadata

    ray_requirements = [r for r in importlib.metadata.requires("sharedml") or [] if "ray" in r]
    assert ray_requirements and all('extra == "ray"' in r for r in ray_requirements)
    code = (
        "import sys, sharedml, sharedml.ray; "
        "print(sorted(m for m in ('ray', 'starlette') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
