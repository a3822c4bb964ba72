"""Which file system holds a path, and whether it serves its pages over a network."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "REMOTE_FILESYSTEMS",
    "filesystem_type",
    "is_remote_filesystem",
]

_MOUNTINFO = "/proc/self/mountinfo"
# File systems whose pages come over a network (or a user-space bridge to one). A mapped file on
# one of them is served by that network, revalidated and evicted by its client, not kept like a
# local file's page cache. FUSE mounts count as remote (sshfs, s3fs, gcsfuse, rclone, blobfuse)
# except ``fuseblk``, a local block device (ntfs-3g, exfat).
REMOTE_FILESYSTEMS = frozenset(
    (
        "9p",
        "afs",
        "beegfs",
        "ceph",
        "cifs",
        "fuse",
        "glusterfs",
        "gpfs",
        "lustre",
        "ncpfs",
        "nfs",
        "nfs4",
        "smb3",
        "smbfs",
        "wekafs",
    )
)


def _unescape_mount_path(text: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes come octal-escaped."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def filesystem_type(path: str | os.PathLike[str], *, mountinfo: str | None = None) -> str | None:
    """The type of the file system that holds ``path`` (``"ext4"``, ``"nfs4"``...).

    Read from ``/proc/self/mountinfo``: the mount whose mount point is the longest prefix of
    ``path``'s real path (the last one mounted wins where mounts are stacked).

    Args:
        path: Any path; it need not exist (its nearest mount is found from the text).
        mountinfo: The text of a mountinfo file, for tests (default: this process's).

    Returns:
        The type, or None where it cannot be read (not Linux, no ``/proc``).
    """
    if mountinfo is None:
        try:
            mountinfo = Path(_MOUNTINFO).read_text()
        except OSError:
            return None
    real = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest.split():
            continue
        mount_point = _unescape_mount_path(parts[4])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= best[0]):
            best = (len(mount_point), rest.split()[0])
    return best[1] if best is not None else None


def is_remote_filesystem(fstype: str | None) -> bool:
    """Whether a file system type (from :func:`filesystem_type`) serves its pages remotely."""
    if fstype is None:
        return False
    return fstype in REMOTE_FILESYSTEMS or (fstype.startswith("fuse.") and fstype != "fuseblk")
