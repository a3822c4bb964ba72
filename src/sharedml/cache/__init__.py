"""sharedml's cache: every file sharedml keeps between processes, and the functions to manage it.

The admin API (what ``sharedml cache info|list|verify|prune|clear`` prints is what these return)::

    import sharedml.cache

    summary = sharedml.cache.cache_summary()            # where, how much, by kind
    entries = sharedml.cache.list_entries()             # every entry, least recently used first
    damaged = [e for e in sharedml.cache.verify_entries() if e.problem]
    sharedml.cache.prune_cache(older_than_s=30 * 86400, max_bytes=20 * 2**30)
    sharedml.cache.clear_cache(dry_run=True)

Each takes ``cache_dir=``: a path, a :class:`Cache`, or None for ``$SHAREDML_CACHE_DIR`` or the
user's cache folder (:func:`cache_dir`). A :class:`Cache` is the folder resolved once: pass one
to ``SessionPool(cache_dir=...)`` and the admin functions alike.

Layout and permission policy (POSIX; the one policy every kind of entry gets)::

    <cache_dir>/                    0700 when sharedml creates it; an existing one may be shared
    │                               only with the sticky bit (like /tmp), else CacheError
    ├── CACHEDIR.TAG                the marker: sharedml uses an existing folder only if it holds
    │                               this file, is empty, or holds nothing but sharedml's own
    ├── <kind>/                     0700, owned by this user, not a symlink: checked on every
    │   │                           use; a lax mode is repaired, another owner is refused
    │   ├── <key>/                  one published entry (0700), never modified after publishing
    │   │   ├── entry.json          what the entry holds: each file's size and SHA-256
    │   │   ├── .lock               not part of the entry: see "In use" below
    │   │   └── <files>             0444
    │   └── .<key prefix>-<owner>-XXXX.tmp/  an entry being built (or a killed build's): never
    │                               read; <owner> (host tag and pid) tells which is which
    ├── stamps/                     0700: "this file, unchanged since, has this digest"
    └── locks/                      0700: empty files that processes lock (``held_lock``)

The kinds of entry (``ENTRY_KINDS``): ``models`` (prepared models, keyed by content: see
:func:`sharedml.prepared_model_for`), ``prepacked`` (ORT's prepacked form of a prepared
model, see :mod:`sharedml.weights`) and ``demo`` (the built-in demo model).

Publishing (``publish``): a builder writes an entry's files into a private temporary folder;
the cache hashes them into ``entry.json``, makes them read-only and renames the folder into
place. Readers therefore never see half an entry; of concurrent builders of one key one rename
wins and the others use the winner's entry. A crashed build leaves only a temporary folder, which
is never read and is removed by ``clear_stale`` once the process its name records is gone
(or, where that cannot be told, once it is a day old).
Published files are never rewritten in place: a mapped file truncated under a running process
would crash it (SIGBUS).

Publishing needs no lock: losers of the race only waste their build. Where a build is worth
avoiding (replicas of a server starting together on a node, each about to prepare the same large
model), callers serialize on ``held_lock`` and find the winner's entry once they hold it.

Opening (``open_entry``): an entry is used only if its folder and files pass the policy above
and every file has the size ``entry.json`` records, and the SHA-256 for the files the caller
names. A damaged entry raises :class:`~sharedml.CacheError`; ``ensure_entry`` moves it aside
and builds it again.

In use: a process that opens an entry takes a shared ``flock`` on its ``.lock`` file and holds
it while it may map the entry's files (``hold_entry``: a weight store, a prepacked model),
touching the lock file's mtime: the entry's "last used". :func:`remove_entries` (``sharedml
cache prune`` and ``clear``) takes an exclusive lock without waiting and skips an entry it
cannot get, so no entry is removed under a live process; a holder that was waiting for the lock
while the entry went sees that its lock file is gone and builds the entry again. Where there is
no ``flock`` (Windows) a holder keeps the lock file open instead; the OS refuses to delete an
open or mapped file there, removal deletes the lock file first and skips the entry at the first
refusal, and stamps are not used (``st_ctime`` is the creation time there, which no write
moves). Removal never follows a symlink: a symlink in the cache is removed itself, its target
left alone; sizes are counted without following links, and a file that several entries
hard-link counts once. What sharedml did not make (in a kind folder: a name that is no key and
holds no ``entry.json``) is reported and never changed or removed.

Trust: the cache is trusted the way a Python ``site-packages`` is. Whoever can write to it can
make every pool run their graph, hence the policy; ``docs/security.md`` has the threat model.

Stamps spare the work that start-up would otherwise repeat in every process: hashing a source
model to find its entry and hashing a weights file to verify it. A stamp records each file's
path as named, the path it resolves to, and its device, inode, size, mtime and ctime; any write
to a file changes its ctime, which no unprivileged process can set back, so a stamp that still
matches names the same bytes. Every path is resolved again when a stamp is recalled, so a
symlink retargeted since (``current.bin -> v2.bin``) misses. The files are snapshotted *before*
their bytes are read (``snapshot``) and a stamp is recorded only if they are unchanged
after, so a write that lands while a file is hashed is never stamped as good. No stamp is
written for a file changed in the last a racy window of 3 s (a write within the timestamp
granularity could leave mtime and ctime as they were; git's index has the same rule).
``SHAREDML_STAMPS=0`` turns stamps off.

The modules behind it, one job each: ``_root`` (the folder and its policy: :class:`Cache`),
``_files`` (temporary names, removal), ``_locks`` (entries in use: ``hold_entry``; named locks:
``held_lock``), ``_stamps``, ``_entries`` (``publish``, ``open_entry``, ``ensure_entry``,
``clear_stale``), ``_admin`` (what this module exports). ``__init__.pyi`` lists the public names.
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
