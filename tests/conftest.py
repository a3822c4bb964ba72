"""Shared test setup: make `tools/` importable and keep caches inside the test's tmp folders."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tools/ holds the model generators
