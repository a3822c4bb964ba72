"""The public surface: exactly what `sharedml.__all__` promises, and nothing private leaks in."""

from __future__ import annotations

import types

import sharedml


def test_all_names_exist_and_are_unique() -> None:
    assert len(sharedml.__all__) == len(set(sharedml.__all__))
    for name in sharedml.__all__:
        assert hasattr(sharedml, name), name


def test_every_public_object_is_exported() -> None:
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
