"""Shared test setup: `tools/` importable, caches in tmp folders, Ray set up for loopback."""

from __future__ import annotations

import builtins
import importlib.abc
import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Property tests draw the same examples on every run (a hash of each test seeds them): drawn
# afresh, a rare graph crashed onnxruntime's CPU Run in CI (a segfault, not a finding of
# sharedml's), and the lying-graphs test drew too few graphs that ORT folds about one run in
# fifteen. HYPOTHESIS_PROFILE=explore draws afresh, to look for new failures on purpose. Loaded
# before any test module builds its settings, which inherit it. The WebGPU and DirectML harnesses
# run a few test files without the test extra: no hypothesis there.
try:
    from hypothesis import settings as _hypothesis
except ImportError:
    pass
else:
    _hypothesis.register_profile("ci", derandomize=True)
    _hypothesis.register_profile("explore", derandomize=False)
    _hypothesis.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tools/ holds the model generators

# Ray reads these when it is first imported (any test module may be first): a cluster on
# 127.0.0.1 is reachable only with the first one (else ray.init rewrites the address to the
# machine's IP and retries forever); no usage-stats thread; quiet routers on 2 busy cores.
for _name, _value in (
    ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
    ("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0"),
    ("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0"),
):
    os.environ.setdefault(_name, _value)

# onnxruntime_extensions sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in os.environ when it
# is imported (onnxruntime_extensions/cvt.py). This process keeps its upb backend, but every
# subprocess a later test starts would inherit the pure-Python one: slower parsing, and a
# sharedml.model._proto that (rightly) falls back to importing onnx. Import it here, once, and undo
# it.
_saved = os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")
try:
    import onnxruntime_extensions  # noqa: F401
except ImportError:
    pass
finally:
    if _saved is None:
        os.environ.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    else:
        os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = _saved


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "capability(name, ...): needs these onnxruntime capabilities "
        "(sharedml.runtime._capabilities); "
        "skipped with the capability's reason where the installed onnxruntime lacks one",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``capability(...)`` where the installed onnxruntime lacks one."""
    from sharedml.runtime._capabilities import capability

    for mark in item.iter_markers("capability"):
        for name in mark.args:
            found = capability(name)
            if not found.available:
                pytest.skip(f"needs onnxruntime capability '{name}': {found.reason}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``dml`` skip, saying why, where no DirectML session can run."""
    marked = [item for item in items if item.get_closest_marker("dml")]
    if not marked:
        return
    from _dml import missing

    reason = missing()
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


_TEST_FOLDERS = pytest.StashKey[set[Path]]()


@pytest.fixture(autouse=True)
def _isolated_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Every test prepares into its own cache, never the user's."""
    request.config.stash.setdefault(_TEST_FOLDERS, set()).add(tmp_path)
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module", autouse=True)
def _module_folders_removed(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[None]:
    """What a module made with ``tmp_path_factory`` is removed when the module ends.

    pytest removes a passed test's ``tmp_path`` as soon as the test ends
    (``tmp_path_retention_policy`` in pyproject.toml), but keeps what ``tmp_path_factory``
    made (the models of module-scoped fixtures, hundreds of MB in some modules) until the
    whole run ends: the peak would be their sum. Kept where a test of the module failed, as
    the failed tests' folders are. A session-scoped fixture must not use ``tmp_path_factory``
    (its folder would go with the first module that used it).
    """
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        tests = request.config.stash.get(_TEST_FOLDERS, set())
        for path in sorted(set(base.iterdir()) - before - tests):
            if path.is_dir() and not path.is_symlink():  # not pytest's "...current" links
                _remove_tree(path)


def _remove_tree(folder: Path) -> None:
    """Remove ``folder``, with what its owner made read-only in it (root needs no help)."""
    if os.name != "posix" or os.geteuid() != 0:
        for parent, dirs, files in os.walk(folder):  # a folder is made writable before entered
            for name in (*dirs, *files):
                path = os.path.join(parent, name)
                if os.path.islink(path):
                    continue
                if os.name == "posix" and os.lstat(path).st_uid != os.geteuid():
                    continue
                os.chmod(path, 0o700 if name in dirs else 0o600)  # Windows: not read-only
    shutil.rmtree(folder)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Interleave threads as often as possible while a concurrency test runs."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # seconds (the default is 5e-3)
    yield
    sys.setswitchinterval(old)


@pytest.fixture
def no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files the test itself just wrote get stamps too (production waits 3 s after a write)."""
    from sharedml.cache import _stamps

    monkeypatch.setattr(_stamps, "RACY_WINDOW_NS", 0)


@pytest.fixture
def forbid_reading(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``forbid_reading(path, ...)``: from now on, opening any of these files fails the test.

    It guards the open calls themselves (``open``, ``io.open``, ``os.open``), not the function a
    module happens to use today, so a new read path cannot slip past it. ``stat`` stays allowed.
    """

    def forbid(*paths: Path) -> None:
        guarded = {os.path.realpath(p) for p in paths}
        real_open, real_os_open = builtins.open, os.open

        def check(file: object) -> None:
            is_path = isinstance(file, (str, bytes, os.PathLike))
            if is_path and os.path.realpath(os.fsdecode(file)) in guarded:  # type: ignore[arg-type]
                raise AssertionError(f"'{os.fsdecode(file)}' was opened again")  # type: ignore[arg-type]

        def guarded_open(file: object, *args: object, **kwargs: object) -> object:
            check(file)
            return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

        def guarded_os_open(path: object, *args: object, **kwargs: object) -> int:
            check(path)
            return real_os_open(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(io, "open", guarded_open)
        monkeypatch.setattr(os, "open", guarded_os_open)

    return forbid


@pytest.fixture
def other_user() -> Iterator[Callable[[Callable[[], None]], None]]:
    """``other_user(fn)``: run ``fn`` as a second local user, created for the test (root only).

    Attacks by another user need two users; the test creates one with ``useradd`` when it runs
    as root and is skipped otherwise. ``fn`` runs in a forked child that has dropped to that
    user (a new interpreter could not start: the Python install may sit in root's home); an
    exception in it fails the test with its message. The user is deleted afterwards.
    """
    yield from _local_user()


def _local_user() -> Iterator[Callable[[Callable[[], None]], None]]:
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second user")
    import pwd

    name = f"shml{secrets.token_hex(4)}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    user = pwd.getpwnam(name)

    def run(fn: Callable[[], None]) -> None:
        _import_what_a_child_may_need()
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():  # fork of a threaded process: the child only does I/O
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            os.close(read_end)
            status = 1
            try:
                sys.meta_path.insert(0, _NothingNewFromSharedml())
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
                fn()
                status = 0
            except BaseException as exc:
                os.write(write_end, f"{type(exc).__name__}: {exc}".encode()[:8000])
            finally:
                os._exit(status)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as fh:
            message = fh.read().decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"as user {name}: {message}"

    run.uid = user.pw_uid  # type: ignore[attr-defined]
    run.gid = user.pw_gid  # type: ignore[attr-defined]
    try:
        yield run
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def second_other_user(
    other_user: Callable[[Callable[[], None]], None],
) -> Iterator[Callable[[Callable[[], None]], None]]:
    """A third user, like ``other_user``: for an attack by one user on another (root only)."""
    yield from _local_user()


class Unprivileged:
    """Where and as whom a test runs what root would hide: see the ``unprivileged`` fixture.

    Attributes:
        folder: A fresh folder owned by that user (removed after the test).
        uid: The user's id.
    """

    def __init__(self, run: Callable[[Callable[[], None]], None], folder: Path, uid: int) -> None:
        self._run = run
        self.folder = folder
        self.uid = uid

    def run(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` as the unprivileged user; its exception fails the test."""
        self._run(fn)


def _import_what_a_child_may_need() -> None:
    """Import every module of sharedml here: a child dropped to another user may not read
    root's Python install (pyenv under /root) or checkout, so it can use only what its parent
    imported. The packages' faces import their modules lazily, on first use: each module is
    imported by name. (sharedml.ray's modules too: they import Ray only when used.)"""
    import importlib
    import pkgutil

    import sharedml

    for name in ("fcntl", "mmap", "onnx.numpy_helper", "onnxruntime"):
        importlib.import_module(name)
    for info in pkgutil.walk_packages(sharedml.__path__, "sharedml."):
        if not info.name.endswith(".__main__"):  # would run the CLI
            importlib.import_module(info.name)


class _NothingNewFromSharedml(importlib.abc.MetaPathFinder):
    """In a child dropped to another user: a sharedml module the parent did not import fails.

    Where the user can read the checkout, such an import would work here and fail only where
    it cannot (a CI checkout under /root): this makes it fail everywhere, naming the module.
    """

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == "sharedml" or fullname.startswith("sharedml."):
            raise ImportError(
                f"{fullname} was not imported before the fork, and a child dropped to another"
                " user may not be able to read it: import it in conftest's"
                " _import_what_a_child_may_need"
            )


@pytest.fixture
def unprivileged(request: pytest.FixtureRequest) -> Iterator[Unprivileged]:
    """Run part of a test as an ordinary user, with a folder of its own.

    Root bypasses file modes, so a permission bug never shows in a suite run as root. Run as
    an ordinary user, the test calls ``fn`` in this process, and puts back the environment
    variables ``fn`` changed (a ``HOME`` pointing into the folder would outlive it); run as
    root, it creates a second user (``other_user``) and calls ``fn`` in a child that dropped
    to it. The folder is removed when the test ends.
    """
    folder = Path(tempfile.mkdtemp(prefix="sharedml-unprivileged-"))
    try:
        if os.name == "posix" and os.geteuid() == 0:
            user = request.getfixturevalue("other_user")
            os.chown(folder, user.uid, user.gid)
            yield Unprivileged(user, folder, user.uid)
        else:
            yield Unprivileged(_in_this_process, folder, os.geteuid() if os.name == "posix" else 0)
    finally:
        _remove_tree(folder)


def _in_this_process(fn: Callable[[], None]) -> None:
    saved = dict(os.environ)
    try:
        fn()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread, as in an interactive session.

    A shell starts a background job (``cmd &`` in a script, as CI runners do) with SIGINT
    ignored, and Python then keeps it ignored: a test that delivers Ctrl-C itself must install
    the default handler, or the signal is lost and the test waits for nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
