"""``sharedml cache``: argument parsing and rendering of what :mod:`sharedml.cache` reports.

Every figure comes from the public cache module's functions (``cache_summary``,
``list_entries``, ``check_entries``, ``prune_cache``, ``clear_cache``); this module only parses
the arguments and renders the results, as text or ``--json``. It also owns ``--cache-dir``,
which every command that touches the cache takes (:func:`add_cache_dir_option`). Nothing here
imports onnx or onnxruntime.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
from typing import Any

from sharedml._units import human_bytes, parse_bytes

__all__ = ["add_cache_dir_option", "add_parser"]

_DAY_S = 24 * 3600  # seconds


def add_cache_dir_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--cache-dir DIR`` to a command: the cache it uses instead of the default."""
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the cache folder to use (default: $SHAREDML_CACHE_DIR, else the user's cache "
        "folder, e.g. ~/.cache/sharedml)",
    )


def add_parser(sub: Any) -> None:
    """Add the ``cache`` subcommand and its actions to the CLI's subparsers."""
    p = sub.add_parser(
        "cache",
        help="show, check and prune sharedml's cache of prepared and prepacked models",
        description=(
            "sharedml's cache (--cache-dir, else $SHAREDML_CACHE_DIR, else the user's cache "
            "folder, e.g. ~/.cache/sharedml) holds each "
            "model prepared once (models/), ORT's prepacked form of it per ORT build and CPU "
            "(prepacked/) and the demo model (demo/). Entries that a live process has open are "
            "never removed."
        ),
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    for name, text in (
        ("info", "where the cache is and how much it holds, by kind"),
        ("list", "every entry: kind, key, size, last used, source, ORT build"),
        ("verify", "read every entry again and check it against its recorded SHA-256"),
    ):
        a = actions.add_parser(name, help=text, description=text[:1].upper() + text[1:] + ".")
        if name != "info":
            a.add_argument(
                "keys",
                nargs="*",
                metavar="KEY",
                help="only these entries: any unique start of a key (or KIND/KEY) as listed",
            )
        a.add_argument("--json", action="store_true", help="print JSON")
        add_cache_dir_option(a)
        a.set_defaults(func=_ACTIONS[name])
    a = actions.add_parser(
        "prune",
        help="remove damaged entries, entries unused for DAYS, or the least recently used",
        description=(
            "Remove damaged entries, entries not used for --older-than DAYS, then the least "
            "recently used until the cache's entries take at most --max-size. Entries in use "
            "are kept."
        ),
    )
    # Parsed in _prune, so that a bad value is one line of error like every other (argparse
    # would print its usage first).
    a.add_argument("--older-than", metavar="DAYS", help="unused for this many days")
    a.add_argument("--max-size", metavar="SIZE", help="e.g. 500M, 2G (binary units)")
    a.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    a.add_argument("--json", action="store_true", help="print JSON")
    add_cache_dir_option(a)
    a.set_defaults(func=_prune)
    a = actions.add_parser(
        "clear",
        help="remove every entry not in use, every stamp, and what killed builds left",
        description=(
            "Remove every entry that no live process has open, every stamp, and the temporary "
            "folders of builds whose process was killed. Files sharedml did not make are left."
        ),
    )
    a.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    a.add_argument("--json", action="store_true", help="print JSON")
    add_cache_dir_option(a)
    a.set_defaults(func=_clear)


def _days(text: str) -> float:
    """``--older-than``: a finite number of days, at least 0.

    Raises:
        ValueError: anything else (NaN and infinity too).
    """
    try:
        days = float(text)
    except ValueError:
        days = math.nan
    if not 0 <= days < math.inf:
        raise ValueError(
            f"--older-than {text!r} is not a number of days: give a finite number, at least 0 "
            "(e.g. 30 or 0.5)."
        )
    return days


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def _key(e: Any) -> str:
    """``kind/key`` as every text report shows it: the key's first KEY_CHARS characters."""
    from sharedml.cache import KEY_CHARS

    return f"{e.kind}/{e.key if e.foreign else e.key[:KEY_CHARS]}"


def _info(args: argparse.Namespace) -> int:
    from sharedml import cache

    s = cache.cache_summary(cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
        return 0
    print(f"cache folder: {s.root}{'' if s.exists else ' (not created yet)'}")
    print(f"total size:   {human_bytes(s.size_bytes)}  (each file once, as du counts it)")
    for kind, (count, size) in s.kinds.items():
        print(f"  {kind + '/':<12} {count:>4} entries  {human_bytes(size):>10}")
    print(f"  {'stamps/':<12} {s.stamps[0]:>4} files    {human_bytes(s.stamps[1]):>10}")
    if s.temporary[0]:
        print(
            f"  {'temporary':<12} {s.temporary[0]:>4} items    {human_bytes(s.temporary[1]):>10}"
            "  (builds in progress, or left by killed builds: 'clear' or 'prune' removes these)"
        )
    if s.foreign[0]:
        print(
            f"  {'not sharedml':<12} {s.foreign[0]:>4} items    {human_bytes(s.foreign[1]):>10}"
            "  (not made by sharedml: left alone, see 'sharedml cache list')"
        )
    if not s.locking:
        print(
            "no flock on this platform: entries in use are held open, so 'list' cannot tell "
            "which are in use; prune and clear skip them (README)"
        )
    return 0


def _selected(args: argparse.Namespace, entries: list[Any]) -> list[Any]:
    from sharedml import cache

    return cache.select_entries(entries, args.keys) if args.keys else entries


def _list(args: argparse.Namespace) -> int:
    from sharedml import cache

    entries = _selected(args, cache.list_entries(cache_dir=args.cache_dir))
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
        return 0
    _print_entries(entries)
    return 0


def _print_entries(entries: Any) -> None:
    from sharedml.cache import KEY_CHARS, disk_bytes

    if not entries:
        print("the cache holds no entries")
        return
    print(f"{'kind':<10} {'key':<16} {'size':>10}  {'last used':<16}  source / ORT build")
    linked = False
    for e in entries:
        if e.foreign:
            print(f"{e.kind:<10} {'-':<16} {human_bytes(e.size_bytes):>10}  {'-':<16}  {e.path}")
            print(f"{'':<10} not made by sharedml: left alone, never changed or removed")
            continue
        busy = "  [in use]" if e.busy else ""
        print(
            f"{e.kind:<10} {e.key[:KEY_CHARS]:<16} {human_bytes(e.size_bytes):>10}  "
            f"{_when(e.last_used):<16}  {e.source or '-'}{busy}"
        )
        if e.ort:
            print(f"{'':<57}{e.ort}")
        if e.problem:
            print(f"{'':<10} damaged: {e.problem}")
        for name, links in sorted(e.linked.items()):
            linked = True
            print(
                f"{'':<10} {name}: shared with other entries ({links} links; freed with the last)"
            )
        if e.uses:
            print(f"{'':<10} uses weights of: {', '.join(k[:KEY_CHARS] for k in e.uses)}")
    own = [e for e in entries if not e.foreign]
    total = disk_bytes(own)
    print(f"{len(own)} entries, {human_bytes(total)} on disk (each shared file counted once)")
    if linked:
        print(
            "a shared file is one file under several names: never copy over one (cp, even as "
            "root), which rewrites it for every entry and kills each process that maps it "
            "(SIGBUS). Entries are removed with 'sharedml cache prune' or 'clear'."
        )


def _verify(args: argparse.Namespace) -> int:
    from sharedml import cache

    entries = cache.check_entries(_selected(args, cache.list_entries(cache_dir=args.cache_dir)))
    bad = [e for e in entries if e.problem and not e.foreign]
    foreign = [e for e in entries if e.foreign]
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
    else:
        for e in entries:
            if e.foreign:
                print(f"not sharedml's {e.path}: left alone")
                continue
            print(f"{'ok     ' if e.problem is None else 'DAMAGED'} {_key(e)}")
            if e.problem:
                print(f"        {e.problem}")
        checked = len(entries) - len(foreign)
        print(
            f"{checked - len(bad)} of {checked} entries intact"
            + (": 'sharedml cache prune --older-than 0' removes what is not" if bad else "")
        )
    return 1 if bad else 0


def _report_removal(args: argparse.Namespace, result: Any) -> int:
    if args.json:
        print(json.dumps(result.to_dict() | {"dry_run": args.dry_run}, indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for e in result.removed:
        print(f"{verb} {_key(e)} ({human_bytes(e.size_bytes)})")
    for e in result.busy:
        print(f"kept   {_key(e)}: in use by a live process")
    for e, why in result.failed:
        print(f"failed {_key(e)}: {why}")
    for e in result.left:
        print(f"left   {e.path}: not made by sharedml, never removed by it")
    print(f"{verb} {len(result.removed)} entries, {human_bytes(result.freed_bytes)} freed on disk")
    return 1 if result.failed else 0


def _prune(args: argparse.Namespace) -> int:
    from sharedml import cache

    older = _days(args.older_than) * _DAY_S if args.older_than is not None else None
    try:
        max_bytes = parse_bytes(args.max_size) if args.max_size is not None else None
    except ValueError as exc:
        raise ValueError(f"--max-size: {exc}") from None
    result = cache.prune_cache(
        older_than_s=older,
        max_bytes=max_bytes,
        dry_run=args.dry_run,
        cache_dir=args.cache_dir,
    )
    return _report_removal(args, result)


def _clear(args: argparse.Namespace) -> int:
    from sharedml import cache

    return _report_removal(args, cache.clear_cache(dry_run=args.dry_run, cache_dir=args.cache_dir))


_ACTIONS = {"info": _info, "list": _list, "verify": _verify}
