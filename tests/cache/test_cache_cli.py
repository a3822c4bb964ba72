"""``--cache-dir`` on every command that uses the cache: that cache is used, the default never.

Each test gives the default cache (``$HOME``'s, no ``$SHAREDML_CACHE_DIR``) an entry of its own
and another folder an entry, runs one command with ``--cache-dir`` on that folder in a fresh
process, and checks that the command saw or changed only that folder's entry and that nothing
in the default cache changed (or, where it held nothing, that it was never created).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _models import build_model, save_model

import sharedml
import sharedml.cache
from sharedml.cache import Cache, _entries

POSIX = os.name == "posix"


@pytest.fixture
def default_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache every command would use without ``--cache-dir``: the user's own, in a tmp HOME."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.delenv("SHAREDML_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USERPROFILE", str(home))  # Windows' home
    # Windows' folders come from the shell, not from the environment: platformdirs 4.x
    # takes this override, so that a test never writes in the user's real cache.
    monkeypatch.setenv("WIN_PD_OVERRIDE_LOCAL_APPDATA", str(home / "AppData" / "Local"))
    folder = sharedml.cache_dir()
    if not POSIX and not folder.is_relative_to(home):
        pytest.skip("this platformdirs has no WIN_PD_OVERRIDE_*: the default cache is the user's")
    assert folder.is_relative_to(home)
    return folder


def sharedml_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m sharedml ARGS`` in a fresh process, in this test's environment."""
    return subprocess.run(
        [sys.executable, "-m", "sharedml", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


def entry(root: Path, key: str) -> Path:
    """A published demo entry ``key`` in the cache ``root``, not held by this process."""

    def build(tmp: Path) -> None:
        (tmp / "f").write_bytes(key.encode() * 1000)

    published = _entries.publish("demo", key, build, cache=Cache(root))
    assert published.hold is not None
    published.hold.release()
    return published.path


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: (size, mtime) by relative path; {} if it is absent."""
    if not root.exists():
        return {}
    found = {}
    for path in sorted(root.rglob("*")):
        st = os.lstat(path)
        found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture
def two_caches(default_cache: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the given cache, the default one), each holding one demo entry: ``given``, ``default``."""
    given = tmp_path / "given cache"
    entry(given, "given")
    entry(default_cache, "default")
    return given, default_cache


def keys(root: Path) -> list[str]:
    return [e.key for e in sharedml.cache.list_entries(cache_dir=root)]


Check = Callable[[subprocess.CompletedProcess[str], Path], None]


def _info(out: subprocess.CompletedProcess[str], given: Path) -> None:
    info = json.loads(out.stdout)
    assert info["root"] == str(given) and info["kinds"]["demo"]["entries"] == 1


def _listed(out: subprocess.CompletedProcess[str], given: Path) -> None:
    assert [e["key"] for e in json.loads(out.stdout)] == ["given"]


def _removed(out: subprocess.CompletedProcess[str], given: Path) -> None:
    assert [e["key"] for e in json.loads(out.stdout)["removed"]] == ["given"]
    assert keys(given) == []


COMMANDS: dict[str, tuple[tuple[str, ...], Check]] = {
    "info": (("cache", "info", "--json"), _info),
    "list": (("cache", "list", "--json"), _listed),
    "verify": (("cache", "verify", "--json"), _listed),
    "prune": (("cache", "prune", "--older-than", "0", "--json"), _removed),
    "clear": (("cache", "clear", "--json"), _removed),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_cache_commands_use_the_cache_dir_given_and_leave_the_default_alone(
    command: str, two_caches: tuple[Path, Path]
) -> None:
    given, default = two_caches
    before = tree(default)
    args, check = COMMANDS[command]
    out = sharedml_cli(*args, "--cache-dir", str(given))
    assert out.returncode == 0, out.stdout + out.stderr
    check(out, given)
    assert tree(default) == before
    assert keys(default) == ["default"]


def test_cache_commands_without_cache_dir_use_the_default(two_caches: tuple[Path, Path]) -> None:
    # The other side of the tests above: the default cache is where these tests look.
    given, default = two_caches
    out = sharedml_cli("cache", "clear", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert keys(default) == [] and keys(given) == ["given"]


def test_a_relative_cache_dir_is_the_folder_it_names(
    two_caches: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    given, _default = two_caches
    monkeypatch.chdir(given.parent)
    out = sharedml_cli("cache", "list", "--json", "--cache-dir", given.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [e["key"] for e in json.loads(out.stdout)] == ["given"]


def test_inspect_uses_the_cache_dir_given(default_cache: Path, tmp_path: Path) -> None:
    # The demo model is built into the cache, and each strategy is measured in a child process
    # whose pool prepares the model into the cache: all of it goes to --cache-dir.
    given = tmp_path / "given"
    args = ("--sessions", "1", "--strategy", "shared-raw", "--json", "--cache-dir", str(given))
    out = sharedml_cli("inspect", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = {e.kind for e in sharedml.cache.list_entries(cache_dir=given)}
    assert {"demo", "models"} <= kinds, kinds
    assert not default_cache.exists()


def test_inspect_of_a_family_uses_the_cache_dir_given(default_cache: Path, tmp_path: Path) -> None:
    given = tmp_path / "given"
    models = [
        str(save_model(build_model(["initializer"], seed=1), tmp_path / f"m{i}.onnx"))
        for i in range(2)
    ]
    out = sharedml_cli("inspect", *models, "--sessions", "1", "--json", "--cache-dir", str(given))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "models" in {e.kind for e in sharedml.cache.list_entries(cache_dir=given)}
    assert not default_cache.exists()


def test_the_cache_dir_of_one_command_does_not_outlive_it(
    two_caches: tuple[Path, Path],
) -> None:
    # main() called from Python (as tests and embedding tools do) restores the environment.
    from sharedml.cli import main

    given, _default = two_caches
    assert main(["cache", "list", "--json", "--cache-dir", str(given)]) == 0
    assert "SHAREDML_CACHE_DIR" not in os.environ


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("prune", "--max-size", "1e400"), "'1e400' is not a size"),  # was an OverflowError
        (("prune", "--max-size", "1e300T"), "'1e300T' is not a size"),
        (("prune", "--max-size=-1G"), "'-1G' is not a size"),
        (("prune", "--older-than", "nan"), "--older-than 'nan' is not a number of days"),
        (("prune", "--older-than", "inf"), "--older-than 'inf' is not a number of days"),
        (("prune", "--older-than=-1"), "--older-than '-1' is not a number of days"),
    ],
)
def test_prune_refuses_limits_that_are_not_finite_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], fragment: str
) -> None:
    from sharedml.cli import main

    kept = entry(tmp_path / "cache", "k" * 64)
    assert main(["cache", *args, "--cache-dir", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert kept.exists()


def test_prune_refuses_a_nan_age_from_python_too(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="finite number of days"):
        sharedml.cache.prune_cache(older_than_s=float("nan"), cache_dir=tmp_path)


@pytest.mark.skipif(not POSIX, reason="/dev/null")
@pytest.mark.parametrize("action", ["info", "list", "verify", "prune", "clear"])
@pytest.mark.parametrize("where", ["/dev/null", "/dev/null/cache", "a file"])
def test_a_cache_dir_that_is_not_a_folder_is_an_error_not_an_empty_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str, where: str
) -> None:
    from sharedml.cli import main

    if where == "a file":
        where = str(tmp_path / "cache")
        Path(where).write_bytes(b"not a folder")
    extra = ["--older-than", "0"] if action == "prune" else []
    assert main(["cache", action, *extra, "--cache-dir", where]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a folder" in err[0] and where in err[0], err
