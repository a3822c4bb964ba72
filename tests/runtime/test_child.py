"""The one child-process runner: a result, or one clear error naming what ran and how it ended.

Measuring, the capability and device probes and family inspect all run their children through
:func:`sharedml.runtime._child.run_child`; these children are real processes that hang, crash,
print garbage or raise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from sharedml._errors import SharedMLError
from sharedml.runtime._child import ChildFailed, entry_code, run_child

# What the entry runs: stdlib functions that take strings, so no test module must be importable.
LOADS = entry_code("json:loads")


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_child_returns_its_result_and_passes_on_its_other_lines() -> None:
    lines: list[str] = []
    code = "print('PROGRESS 1 2'); print('RESULT ' + '{\"n\": [1, 2]}'); print('after')"
    assert run_child([], code=code, what="Counting", timeout_s=60, on_line=lines.append) == {
        "n": [1, 2]
    }
    assert lines == ["PROGRESS 1 2", "after"]


def test_the_entry_runs_a_function_on_the_childs_arguments() -> None:
    assert run_child(["[1, 2.5]"], code=LOADS, what="Parsing", timeout_s=60) == [1, 2.5]


@pytest.mark.skipif(
    bool(sys.flags.ignore_environment),
    reason="this Python ignores PYTHONPATH (Python's embeddable Windows build: its ._pth file)",
)
def test_the_child_imports_what_this_process_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder added to sys.path at run time (as a launcher or a notebook does) reaches the
    # child too: child_env() passes it on in PYTHONPATH.
    (tmp_path / "sharedml_test_child_target.py").write_text("def hello(name):\n    return [name]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = entry_code("sharedml_test_child_target:hello")
    assert run_child(["there"], code=code, what="Greeting", timeout_s=60) == ["there"]
    code = "import json, sharedml; print('RESULT ' + json.dumps(sharedml.__file__))"
    found = run_child([], code=code, what="Importing", timeout_s=60)
    import sharedml

    assert Path(found) == Path(sharedml.__file__)


def test_a_child_that_times_out_is_killed_and_named() -> None:
    before = children()
    code = "import sys, time; print('still working', file=sys.stderr, flush=True); time.sleep(60)"
    with pytest.raises(ChildFailed) as caught:
        run_child([], code=code, what="Measuring strategy 'slow'", timeout_s=1)
    error = caught.value
    assert error.timed_out and error.timeout_s == 1
    assert str(error) == (
        "Measuring strategy 'slow' took longer than 1 s and was stopped. "
        "Last stderr line: still working"
    )
    assert children() <= before  # no child left behind


def test_a_child_that_crashes_says_with_what() -> None:
    # A real crash, reading address 0 in C.
    with pytest.raises(ChildFailed) as caught:
        run_child(
            [], code="import faulthandler; faulthandler._read_null()", what="Probing", timeout_s=60
        )
    error = caught.value
    crash = "STATUS_ACCESS_VIOLATION, 0xC0000005" if os.name == "nt" else "SIGSEGV"
    assert error.crash == crash and not error.timed_out
    assert str(error).startswith(f"Probing crashed ({crash}). Last stderr line: ")


def test_a_child_that_prints_garbage_gives_one_error_not_a_json_error() -> None:
    with pytest.raises(ChildFailed, match=r"^Reading gave a result that is not JSON \('\{nope'\)"):
        run_child([], code="print('RESULT {nope')", what="Reading", timeout_s=60)
    with pytest.raises(ChildFailed, match=r"^Reading exited without a result\. .*: hello$"):
        code = "import sys; print('no result here'); print('hello', file=sys.stderr)"
        run_child([], code=code, what="Reading", timeout_s=60)


def test_a_function_that_raises_gives_its_error_as_one_line() -> None:
    with pytest.raises(ChildFailed) as caught:
        run_child(["{broken"], code=LOADS, what="Parsing", timeout_s=60)
    error = caught.value
    assert error.returncode == 1 and error.crash is None
    assert str(error).startswith("Parsing failed: its process exited with status 1. ")
    assert error.last.startswith("JSONDecodeError: ") and "\n" not in str(error)
    assert isinstance(error, SharedMLError)


def test_a_callback_that_raises_leaves_no_child() -> None:
    before = children()

    def stop(line: str) -> None:
        raise KeyboardInterrupt

    code = "import time; print('PROGRESS 1 9', flush=True); time.sleep(60)"
    with pytest.raises(KeyboardInterrupt):
        run_child([], code=code, what="Stopping", timeout_s=60, on_line=stop)
    assert children() <= before


def test_a_child_that_cannot_start_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(ChildFailed, match=r"^Starting could not start .*nonexistent.*: "):
        run_child([], code="pass", what="Starting", timeout_s=60)
