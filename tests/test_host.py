"""_files.open_below: open a file below a folder without following a symlink, on every route."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharedml._host import _files

POSIX = os.name == "posix"
ROUTES = ["no-follow", "descriptor-path", "stat"]  # openat + O_NOFOLLOW; the two fallbacks


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param != "no-follow":  # what Windows takes, run here
        monkeypatch.setattr(_files, "_O_NOFOLLOW", 0)
    if request.param == "stat":  # a platform that cannot name a descriptor's file
        monkeypatch.setattr(_files, "_descriptor_path", lambda fd: None)
    return str(request.param)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "model" / "sub").mkdir(parents=True)
    (tmp_path / "model" / "sub" / "w.bin").write_bytes(b"inside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "w.bin").write_bytes(b"secret")
    return Path(os.path.realpath(tmp_path / "model"))


def read(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def test_a_file_below_the_folder_is_opened(folder: Path, route: str) -> None:
    assert read(_files.open_below(folder, folder / "sub" / "w.bin")) == b"inside"


@pytest.mark.skipif(not POSIX, reason="symlinks")
@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_symlink_where_the_check_saw_none_is_refused(
    folder: Path, route: str, where: str
) -> None:
    # The caller resolved sub/w.bin before; now a link to the outside stands in its place.
    outside = folder.parent / "outside"
    if where == "file":
        (folder / "sub" / "w.bin").unlink()
        (folder / "sub" / "w.bin").symlink_to(outside / "w.bin")
    else:
        (folder / "sub" / "w.bin").unlink()
        (folder / "sub").rmdir()
        (folder / "sub").symlink_to(outside)
    with pytest.raises(_files.LinkSwappedError):
        read(_files.open_below(folder, folder / "sub" / "w.bin"))


def test_the_folder_itself_is_not_a_file(folder: Path) -> None:
    with pytest.raises(IsADirectoryError):
        _files.open_below(folder, folder)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_is_opened_without_waiting_for_a_writer(folder: Path, route: str) -> None:
    # Callers fstat the descriptor and refuse it; the open itself must not block.
    os.mkfifo(folder / "pipe")
    fd = _files.open_below(folder, folder / "pipe")
    try:
        assert _files.file_kind(os.fstat(fd).st_mode) == "a FIFO (named pipe)"
    finally:
        os.close(fd)
