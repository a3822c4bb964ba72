"""How prepare's outputs reach disk: temporary files, atomic replaces, and clear write errors.

Every output is written to a hidden temporary file beside it, made durable, and renamed over
the final name, so that a reader sees the old file or the new one, never half of one. A killed
prepare leaves its temporary files behind; the next prepare into the folder removes them
(:func:`remove_dead_temps`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sharedml._errors import OutputError, PrepareError
from sharedml._host import _files
from sharedml.cache._files import remove_tree, temp_is_stale, temp_owner
from sharedml.model._graph import external_locations

if TYPE_CHECKING:
    from sharedml.model._proto import GraphProto

__all__ = [
    "COPY_CHUNK_BYTES",
    "SourceFile",
    "check_outputs",
    "create_temp",
    "keep_a_link",
    "output_error",
    "remove_dead_temps",
    "replace_file",
    "replace_output",
    "same_file",
    "scratch_folder",
    "source_files",
    "write_temp",
]

COPY_CHUNK_BYTES = 16 * 1024 * 1024  # bytes copied at a time: bounds prepare's peak memory
_NAME_MAX_BYTES = 255  # bytes in one file name (NAME_MAX on Linux, macOS and NTFS)
# Temporary outputs: ``.<output name>.<owner>-<12 hex>.tmp`` beside the output (the owner, see
# sharedml.cache._files.temp_owner; older ones have none).
_TEMP_NAME = re.compile(
    r"\.(?P<name>.+)\.(?:(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)-)?[0-9a-f]{12}\.tmp"
)
# Scratch folders of compress and compress_static: ``.sharedml-<label>-<owner>-<random>``
# (tempfile's random part; older ones have no owner).
_SCRATCH_NAME = re.compile(
    r"\.sharedml-(?:static|compress)-(?:(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)-)?[a-z0-9_]+"
)
_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)
_WINDOWS_IN_USE = (5, 32)  # ERROR_ACCESS_DENIED, ERROR_SHARING_VIOLATION


def create_temp(final: Path) -> tuple[int, Path]:
    """A new temporary file beside ``final``: read-only for everyone the umask lets read it.

    The mode is 0444 less the umask (``tempfile.mkstemp`` would make it 0600, so a prepared
    model would be unreadable by the other users a deployment often runs its workers as).
    Read-only because the weights file is mapped by running pools: a ``cp`` over it (an
    in-place rewrite) would crash them with SIGBUS, and read-only makes ``cp`` fail for
    everyone but root, while the renames that prepare itself replaces files with still work.
    Windows: 0666, since there a read-only file cannot be replaced by a rename.

    The name records this process (:func:`sharedml.cache._files.temp_owner`), so that the next
    prepare into the folder removes what a killed one left (:func:`remove_dead_temps`), and
    keeps at most what fits NAME_MAX with its owner and random part, so that an output name of
    up to 255 bytes works.

    Returns:
        The open file descriptor (write-only) and the file's path.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    mode = 0o444 if os.name == "posix" else 0o666
    for _ in range(100):
        suffix = f".{temp_owner()}-{secrets.token_hex(6)}.tmp"
        keep = final.name
        while len(os.fsencode(f".{keep}{suffix}")) > _NAME_MAX_BYTES:
            keep = keep[:-1]
        path = final.with_name(f".{keep}{suffix}")
        try:
            return os.open(path, flags, mode), path
        except FileExistsError:
            continue
    raise PrepareError(f"Could not create a temporary file beside '{final}'.")  # pragma: no cover


def write_temp(final: Path, data: bytes) -> Path:
    """Write ``data`` durably to a new temporary file beside ``final``; returns its path.

    The caller renames it into place (or removes it): :func:`replace_file` does the first.
    """
    fd, tmp = create_temp(final)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file and rename it over ``path``.

    ``path`` may be a file prepare wrote read-only (0444): rewriting it in place works only for
    root, and a rename is what prepare itself replaces its outputs with.
    """
    tmp = write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def remove_dead_temps(folder: Path) -> tuple[Path, ...]:
    """Remove the temporary outputs and scratch folders that killed writers left in ``folder``.

    A ``kill -9`` while prepare writes leaves its hidden temporary files (a weights file's
    worth each), and one during compress or compress_static its scratch folder (the prepared
    float model, the quantizer's output: tens of MB), which nothing else would ever remove.
    Only files named as :func:`create_temp` names them and folders named as
    :func:`scratch_folder` names them, owned by this user, and stale (their process is gone
    from this host, or they are a day old: :func:`sharedml.cache._files.temp_is_stale`, the
    cache's own rule) are removed: never a live writer's, in this process or another, and
    never another user's.

    Returns:
        What was removed.
    """
    removed = []
    try:
        children = list(os.scandir(folder))
    except OSError:
        return ()
    for child in children:
        match = _TEMP_NAME.fullmatch(child.name)
        scratch = _SCRATCH_NAME.fullmatch(child.name) if match is None else None
        if match is None and scratch is None:
            continue
        try:
            st = child.stat(follow_symlinks=False)
        except OSError:
            continue
        is_kind = stat.S_ISREG(st.st_mode) if scratch is None else stat.S_ISDIR(st.st_mode)
        if not is_kind or (os.name == "posix" and st.st_uid != os.geteuid()):
            continue
        found = match if match is not None else scratch
        assert found is not None
        owner = (found["host"], int(found["pid"])) if found["host"] else None
        if temp_is_stale(Path(child.path), owner):
            with contextlib.suppress(OSError):
                if scratch is None:
                    os.unlink(child.path)
                else:
                    remove_tree(Path(child.path))
                removed.append(Path(child.path))
    return tuple(removed)


@contextlib.contextmanager
def scratch_folder(folder: Path, label: str) -> Iterator[Path]:
    """A private scratch folder in ``folder`` for one call, removed when it ends.

    Named ``.sharedml-<label>-<owner>-<random>`` (the owner: this host and process, as the
    cache names its temporaries), so that the next writer into ``folder`` removes it if a
    ``kill -9`` left it (:func:`remove_dead_temps`, run here first). Made on the
    destination's filesystem: the result is prepared from it at the destination.
    """
    remove_dead_temps(folder)
    prefix = f".sharedml-{label}-{temp_owner()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=folder) as tmp:
        yield Path(tmp)


def keep_a_link(path: Path) -> Path | None:
    """A hard link to an existing ``path`` under a temporary name, to restore it from; else None.

    None too where the filesystem has no hard links: a failure then loses the old weights file
    (the old graph, still in place, refuses the new one by its recorded hash).
    """
    if not path.is_file() or path.is_symlink():
        return None
    if _kept_by_sticky_folder(path) is not None:
        # Another user's file in a sticky folder: this user could not remove a link to it
        # either, so a failure would leave the link behind (and the file cannot be replaced).
        return None
    for _ in range(100):
        link = path.with_name(f".{path.name[:200]}.{secrets.token_hex(6)}.old")
        try:
            os.link(path, link)
            return link
        except FileExistsError:
            continue
        except OSError:
            return None
    return None  # pragma: no cover


SourceFile = tuple[Path, str]  # a file a call reads, and what it is (for messages)


def source_files(model_path: Path, graph: GraphProto) -> tuple[SourceFile, ...]:
    """The files a model is made of: the model file and every external data file it names.

    Args:
        model_path: The model file.
        graph: Its graph (external data need not be loaded).
    """
    files: list[SourceFile] = [(model_path, "the source model")]
    files += [
        (model_path.parent / location, f"external data of the source model '{model_path}'")
        for location in sorted(external_locations(graph))
        if location and "\0" not in location
    ]
    return tuple(files)


def check_outputs(
    outputs: Iterable[Path], sources: Sequence[SourceFile], *, writer: str, fix: str
) -> None:
    """Refuse outputs that are not regular files, or that are (or alias) a file a call reads.

    Every sharedml call that writes files a user names runs this before it does any work:
    prepare, prepare_family, compress, compress_static, and the CLI's outputs. An output that
    is a source file, or another name for one (a hard link, a symlink to it, the same file
    through another folder or in another letter case on a case-insensitive filesystem: the
    same device and inode), would replace the source with the result: ``compress(m, m)``
    once did. An existing output must be a regular file: ``os.replace`` would replace a
    symlink itself, and, as root, a device (``-o /dev/null``) or a FIFO.

    Args:
        outputs: The paths the call will write.
        sources: The files it reads (:func:`source_files`, plus any other input file).
        writer: The call, for the message (``"compress"``).
        fix: What to do instead, for the message (``"write to another path (-o ...)"``).

    Raises:
        PrepareError: naming the output, what it is, and ``fix``. Nothing was written.
    """
    for out in outputs:
        try:
            st = os.lstat(out)
        except OSError:  # absent (or its folder is): nothing to protect, and a clear error later
            continue
        if not stat.S_ISREG(st.st_mode):
            raise PrepareError(
                f"{writer} would replace '{out}', which is {_files.file_kind(st.st_mode)}; it "
                "replaces only regular files. Remove it or choose another output path. Nothing "
                "was written."
            )
        owner = _kept_by_sticky_folder(out)
        if owner is not None:
            raise _sticky_error(out, owner)
        for path, what in sources:
            if same_file(out, path):
                alias = (
                    ""
                    if os.path.abspath(out) == os.path.abspath(path)
                    else (f" (the same file under another name: '{path}')")
                )
                raise PrepareError(
                    f"{writer} would overwrite its source: '{out}' is {what}{alias}. Nothing "
                    f"was written; {fix}."
                )


def _kept_by_sticky_folder(path: Path) -> int | None:
    """The owner of ``path`` where a sticky folder keeps this user from replacing it, else None.

    In a sticky folder (``/tmp``, a shared deploy folder: mode 1777) only a file's owner, the
    folder's owner and root may rename over it or remove it.
    """
    if os.name != "posix":
        return None
    try:
        st = os.lstat(path)
        folder = os.stat(path.parent)
    except OSError:
        return None
    me = os.geteuid()
    if me == 0 or me in (st.st_uid, folder.st_uid) or not folder.st_mode & stat.S_ISVTX:
        return None
    return st.st_uid


def _sticky_error(path: Path, owner: int) -> PrepareError:
    return PrepareError(
        f"'{path}' belongs to user id {owner}, and this folder does not let you replace "
        "another user's file (sticky bit). It is not used: that user could change a running "
        "pool's weights through it. Remove it (as its owner) or write into a folder of your "
        "own. Nothing was written."
    )


def replace_output(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` over ``path``; where a sticky folder forbids it, say whose file is in the way.

    :func:`check_outputs` refuses such an output before any work; this covers a file planted
    in between.

    Raises:
        PrepareError: a sticky folder keeps another user's file at ``path``.
        OSError: the rename failed otherwise (the caller turns it into an ``OutputError``).
    """
    try:
        os.replace(tmp, path)
    except PermissionError as exc:
        owner = _kept_by_sticky_folder(path)
        if owner is None:
            raise
        raise _sticky_error(path, owner) from exc


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` both exist and are one file (False where that cannot be told)."""
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _in_use_on_windows(path: Path, exc: OSError) -> bool:
    """Whether Windows refused to replace ``path`` because a process has it open or mapped.

    There the old file cannot be replaced while it is mapped; on POSIX the rename lands and
    processes keep the old inode.
    """
    return (
        os.name == "nt"
        and getattr(exc, "winerror", None) in _WINDOWS_IN_USE
        and os.path.lexists(path)
    )


def output_error(path: Path, exc: OSError) -> OutputError:
    """An :class:`OutputError` that names ``path``, the OS's reason and the fix."""
    code = exc.errno
    folder = path.parent
    if code in (errno.ENOSPC, _EDQUOT):
        fix = f"free space on the filesystem of '{folder}', or write the prepared model elsewhere"
    elif code == errno.EFBIG:
        fix = (
            "the file outgrew the filesystem's or this process's file size limit ('ulimit -f'); "
            "raise the limit or write the prepared model elsewhere"
        )
    elif _in_use_on_windows(path, exc):
        fix = (
            "it is in use: Windows refuses to replace a file that a process has open or mapped "
            "(a SessionPool over this prepared model); close those pools first, or prepare to a "
            "new path and point new pools at it"
        )
    elif code in (errno.EACCES, errno.EPERM):
        fix = f"this user may not write in '{folder}'; fix its permissions or write elsewhere"
    elif code == errno.EROFS:
        fix = f"'{folder}' is on a read-only filesystem; write the prepared model elsewhere"
    elif code == errno.ENAMETOOLONG:
        fix = "the name is longer than the filesystem allows; choose a shorter output name"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        fix = f"a part of '{folder}' is a file, not a folder; choose another output path"
    else:
        fix = f"check '{folder}', or write the prepared model elsewhere"
    error = OutputError(
        f"prepare could not write '{path}' ({exc.strerror or exc}): {fix}. The source is "
        "unchanged and no temporary file was left."
    )
    error.errno = code
    return error
