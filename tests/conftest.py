"""Shared test setup: make `tools/` importable and keep caches inside the test's tmp folders."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tools/ holds the model generators


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test prepares into its own cache, never the user's."""
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Interleave threads as often as possible while a concurrency test runs."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)
