"""The public surface: exactly what `sharedml.__all__` promises, and nothing private leaks in."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import sharedml

# The layers of the public face. Changing one is an API change: say so in CHANGELOG.md.
APPLICATION = {
    "SessionPool", "PoolStats", "Calibration", "Batching", "prepare", "prepare_family",
    "PrepareResult", "FamilyResult",
    "prepared_model_for", "inspect", "InspectReport", "Finding", "InputSpec", "cache_dir",
}  # fmt: skip
MODULES = {
    "sharedml.weights": {
        "WeightStore", "TensorSlot", "zero_copy_mechanisms", "DeviceWeightStore", "HostWeights",
        "device_mechanism_available",
    },
    "sharedml.pool": {
        "SessionPool", "PoolStats", "Calibration", "CalibrationCandidate", "Batching",
        "BatchingDefault", "BatchingSetting", "DEFAULT_SESSIONS",
    },
    "sharedml.route": {"SessionRecipe", "Mechanism", "Prepacking"},
    "sharedml.runtime": {
        "ProviderPlan", "ProviderSpec", "ProviderFacts", "PROVIDER_FACTS", "DeviceSelector",
        "PluginDevice", "RunsRule", "WeightsRoute",
    },
    "sharedml.prepared": {
        "prepare", "prepare_family", "PrepareResult", "FamilyResult", "TensorDigest",
        "WeightsManifest",
        "SharedWeights", "weights_path_for", "prepared_model_for", "compress", "CompressResult",
        "WeightsFormat", "compressed_model_for", "compress_static", "StaticCompressResult",
    },
    "sharedml.cache": {
        "Cache", "cache_dir", "cache_summary", "list_entries", "verify_entries", "prune_cache",
        "clear_cache",
    },
    "sharedml.measure": {
        "measure", "Measurement", "MemoryPoint", "FixedCost", "Strategy", "StrategyContext",
        "SessionSet", "Runner", "register_strategy", "registered_strategies", "WeightsSummary",
        "PlacementSummary", "TensorInfo", "ChosenSize", "IndexedTable", "CompressedAccuracy",
        "OutputAccuracy",
    },
}  # fmt: skip


def _public_modules() -> dict[str, types.ModuleType]:
    return {name: importlib.import_module(name) for name in ["sharedml", *MODULES]}


def test_the_top_level_is_what_an_application_needs_and_the_errors() -> None:
    errors = {n for n in sharedml.__all__ if n.endswith(("Error", "Timeout"))}
    assert set(sharedml.__all__) - errors == APPLICATION | {"__version__"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_public_module_exports_its_layer(module: str) -> None:
    assert set(importlib.import_module(module).__all__) >= MODULES[module]


def test_all_names_exist_and_are_unique() -> None:
    for module in _public_modules().values():
        assert len(module.__all__) == len(set(module.__all__))
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_every_public_object_is_exported() -> None:
    for module in _public_modules().values():
        for name in module.__all__:  # loaded on first use (PEP 562): load them all
            getattr(module, name)
        public = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and not isinstance(value, types.ModuleType)
            and name != "annotations"
        }
        assert public == set(module.__all__) - {"__version__"}, module.__name__


def test_a_name_that_left_the_top_level_is_refused_naming_its_public_module() -> None:
    left = 0
    for module, names in MODULES.items():
        for name in sorted(names - set(sharedml.__all__) - {m.split(".")[1] for m in MODULES}):
            home = re.escape(f"import it from {module} ({module}.{name})")
            with pytest.raises(AttributeError, match=home):
                getattr(sharedml, name)
            left += 1
    assert left >= 10  # WeightStore, SessionRecipe, Mechanism, measure's names, ...
    with pytest.raises(AttributeError, match="NoSuchThing") as caught:
        sharedml.NoSuchThing  # noqa: B018
    assert "import it from" not in str(caught.value)


def test_calling_the_measure_module_is_refused_naming_the_function() -> None:
    with pytest.raises(TypeError, match=r"call sharedml\.measure\.measure\(\.\.\.\)"):
        sharedml.measure("m.onnx", sessions=2)  # type: ignore[operator]
    assert callable(sharedml.measure.measure)


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


def test_public_objects_name_their_public_module() -> None:
    for module in _public_modules().values():
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, (type, types.FunctionType)):
                home = "sharedml" if name in sharedml.__all__ else module.__name__
                assert obj.__module__ == home, f"{module.__name__}.{name}"
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
    exported = {n for m in _public_modules().values() for n in m.__all__}
    missing = set()
    for module in _public_modules().values():
        for name in module.__all__:
            for hint in _annotations_of(getattr(module, name)):
                for ident in re.findall(r"[A-Z][A-Za-z0-9_]+", hint):
                    for home in [m for n, m in sys.modules.items() if _private_module(n)]:
                        value = getattr(home, ident, None)
                        ours = isinstance(value, type) and value.__module__.startswith("sharedml")
                        if ours and ident not in exported:
                            missing.add(f"{module.__name__}.{name} -> {ident}")
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
