"""The shared fixtures of conftest.py keep their promises (a broken fixture passes every test)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import sharedml

if TYPE_CHECKING:
    from tests.conftest import Unprivileged

TESTS = Path(__file__).resolve().parent
SRC = Path(sharedml.__file__).parent


def test_the_parent_imports_every_sharedml_module_a_child_of_another_user_may_need() -> None:
    # In a fresh interpreter: this one imported most of sharedml long ago.
    code = (
        "import sys, conftest; conftest._import_what_a_child_may_need(); "
        "print(' '.join(m for m in sys.modules if m.startswith('sharedml')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    imported = set(done.stdout.split())
    on_disk = {
        ".".join(("sharedml", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        for p in SRC.rglob("*.py")
        if p.name != "__main__.py"
    }
    assert sorted(on_disk - imported) == []


def test_a_child_of_another_user_cannot_import_what_its_parent_did_not(
    other_user: Callable[[Callable[[], None]], None],
) -> None:
    # A __main__ module is the one thing the parent leaves out (it would run the CLI).
    with pytest.raises(AssertionError, match="was not imported before the fork"):
        other_user(lambda: importlib.import_module("sharedml.cli.__main__") and None)


def test_every_test_prepares_into_a_cache_of_its_own(tmp_path: Path) -> None:
    from sharedml.cache import cache_dir

    assert cache_dir().resolve().is_relative_to(tmp_path.resolve()), "the user's cache"


def test_unprivileged_puts_back_the_environment_its_function_changed(
    unprivileged: Unprivileged,
) -> None:
    # Run as an ordinary user, fn runs in this process: a HOME left pointing into the folder
    # would send later tests' caches there, after the folder was removed.
    before = dict(os.environ)

    def move_home() -> None:
        os.environ["HOME"] = str(unprivileged.folder / "home")
        os.environ.pop("SHAREDML_CACHE_DIR", None)

    unprivileged.run(move_home)
    assert dict(os.environ) == before
