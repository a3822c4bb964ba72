"""Identical tensors of different models, stored and mapped once through the cache.

When the cache prepares a model (a ``models`` entry, :func:`sharedml.prepared_model_for`),
every tensor of its weights file is looked up by content
(:class:`~sharedml.prepared._format.TensorDigest`: dtype, shape, length and SHA-256 of the
bytes; never the name) among the tensors that other ``models`` entries recorded. A tensor
found there is not kept in the new entry's own weights file: its graph points at a hard link
to the other entry's file (``shared-<sha16>.weights``, named by that file's SHA-256), whose
bytes are checked before they are used. The entry's manifest lists the linked files (format
3, :class:`sharedml.prepared.SharedWeights`), and the weight store maps each file once per
process by inode (:class:`sharedml.weights.WeightStore`), so the pools of both models, on the
raw route and the device route, use one copy, and other processes share its pages.

What is never shared, and why (ORT has onnx's checker validate the external data of tensors in
subgraphs, and onnx refuses a data file with more than one hard link, "a potential hardlink
attack"): a tensor inside a subgraph never points at a link, and a file that a subgraph tensor
refers to is never lent. Entries of other alignment settings are not matched either.

Entries stay immutable and self-contained: a link is a reference count, so removing the entry
that wrote a file first leaves the bytes to the entries that link it (``sharedml cache list``
shows ``linked`` and ``uses``). Tensors of the same model that are the same bytes (tied weights)
were already stored once by prepare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from sharedml._errors import CacheError
from sharedml.cache._entries import iter_entries
from sharedml.cache._root import Cache
from sharedml.cache._stamps import verified_sha256
from sharedml.model._graph import ExternalData, iter_tensors, load_graph, set_external
from sharedml.prepared._files import COPY_CHUNK_BYTES, create_temp, replace_file
from sharedml.prepared._format import (
    SharedWeights,
    TensorDigest,
    WeightsManifest,
    WeightsWriter,
    read_manifest,
    write_manifest,
)

__all__ = ["Dedupe", "share_with_entries"]

_KIND = "models"
SHARED_PREFIX = "shared-"  # a weights file hard-linked from another models entry
_SHARED_SUFFIX = ".weights"


@dataclasses.dataclass(frozen=True)
class Dedupe:
    """What :func:`share_with_entries` did to an entry being built.

    Attributes:
        meta: To record in the entry: ``tensors`` (its lendable tensors, for later entries)
            and ``shared`` (``files``: each linked file -> the entry it came from; ``tensors``
            and ``bytes`` no longer stored in this entry's own file).
        sha256: The SHA-256 of every weights file of the entry, by name (the linked ones'
            from the entries they came from, checked in this build).
    """

    meta: dict[str, Any]
    sha256: dict[str, str]


def _layout(manifest: WeightsManifest) -> list[int]:
    return [manifest.alignment_bytes, manifest.small_alignment_bytes]


def _index(
    model: Any, folder: Path, manifest: WeightsManifest, *, lendable: bool
) -> list[dict[str, Any]]:
    """Each main-graph tensor in a weights file: its match, file and offset.

    ``lendable``: only the files that no subgraph tensor refers to (see the module docstring).
    """
    refs = [(ref, ExternalData.of(ref.tensor)) for ref in iter_tensors(model.graph)]
    names = {f.file for f in manifest.files}
    barred = {info.location for ref, info in refs if info is not None and ref.depth}
    if not lendable:
        barred = set()
    maps: dict[str, np.ndarray] = {}
    index = []
    seen: set[tuple[str, int]] = set()
    for ref, info in refs:
        if info is None or ref.depth or info.location not in names or info.location in barred:
            continue
        if (info.location, info.offset) in seen or info.length is None:
            continue
        seen.add((info.location, info.offset))
        data = maps.get(info.location)
        if data is None:
            data = np.memmap(folder / info.location, dtype=np.uint8, mode="r")
            maps[info.location] = data
        piece = data[info.offset : info.offset + info.length]
        match = TensorDigest(
            ref.tensor.data_type, tuple(ref.tensor.dims), info.length, _sha256(piece)
        )
        index.append({"match": match.as_json(), "file": info.location, "offset": info.offset})
    return index


def _sha256(data: Any) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


def _offers(
    tmp: Path, wanted: set[TensorDigest], layout: list[int], cache: Cache
) -> dict[TensorDigest, tuple[Any, dict[str, Any]]]:
    """For each wanted match, the first other entry that recorded it (and is usable)."""
    offers: dict[TensorDigest, tuple[Any, dict[str, Any]]] = {}
    for entry in iter_entries(_KIND, cache=cache):
        if isinstance(entry, CacheError) or entry.path == tmp:
            continue
        if entry.meta.get("layout") != layout:
            continue
        for item in entry.meta.get("tensors") or ():
            match = TensorDigest.from_json(item.get("match"))
            if match in wanted and match not in offers and item.get("file") in entry.files:
                offers[match] = (entry, item)
    return offers


def share_with_entries(tmp: Path, model_name: str, cache: Cache) -> Dedupe:
    """Point the tensors of the entry being built in ``tmp`` at identical ones of other entries.

    ``tmp/model_name`` is a model that :func:`sharedml.prepare` just wrote (one weights file).
    Its tensors found in other entries are dropped from its own weights file, which is written
    again with only the rest (by prepare's layout rule); the graph and its manifest are
    rewritten to name the linked files. Nothing changes where nothing matches, or where hard
    links are refused (another filesystem): those tensors keep the entry's own copy.
    """
    model_path = tmp / model_name
    model = load_graph(model_path)
    manifest = read_manifest(model)
    assert manifest is not None, "share_with_entries takes a prepared model"
    own = _index(model, tmp, manifest, lendable=False)
    unchanged = Dedupe(
        {"layout": _layout(manifest), "tensors": _index(model, tmp, manifest, lendable=True)},
        {manifest.file: manifest.sha256},
    )
    layout = _layout(manifest)
    own_file = manifest.file
    sha = {own_file: manifest.sha256}
    wanted = {m for item in own if (m := TensorDigest.from_json(item["match"])) is not None}
    offers = _offers(tmp, wanted, layout, cache) if wanted else {}
    if not offers:
        return unchanged

    linked: dict[tuple[str, str], str] = {}  # (entry key, its file) -> link name in tmp
    uses: dict[str, str] = {}  # link name -> entry key
    shared_sizes: dict[str, int] = {}
    moved: dict[tuple[str, int], tuple[str, int]] = {}  # own (file, offset) -> (link, offset)
    maps: dict[str, np.ndarray] = {}
    shared_bytes = 0
    for item in own:
        match = TensorDigest.from_json(item["match"])
        offer = offers.get(match) if match is not None else None
        if offer is None or match is None:
            continue
        entry, theirs = offer
        name = linked.get((entry.key, theirs["file"]))
        if name is None:
            size, digest = entry.files[theirs["file"]]
            name = entry.link_file(theirs["file"], tmp, SHARED_PREFIX, _SHARED_SUFFIX)
            if name is None:
                continue  # no hard link here: keep this entry's own copy
            # The whole file, as the new manifest records it (a stamp spares the read).
            if not verified_sha256(tmp / name, digest, cache=cache):
                (tmp / name).unlink()
                continue
            linked[(entry.key, theirs["file"])] = name
            uses[name] = entry.key
            sha[name] = digest
            shared_sizes[name] = size
        # Another entry's record is not trusted for content: the linked bytes are hashed.
        offset, length = int(theirs["offset"]), match.length
        data = maps.get(name)
        if data is None:
            data = maps[name] = np.memmap(tmp / name, dtype=np.uint8, mode="r")
        if offset + length > data.size or _sha256(data[offset : offset + length]) != match.sha256:
            continue
        moved[(item["file"], item["offset"])] = (name, offset)
        shared_bytes += length
    maps.clear()
    for name in set(uses) - {link for link, _offset in moved.values()}:
        (tmp / name).unlink()  # linked, then every tensor of it failed the byte check
        uses.pop(name)
        sha.pop(name)
    if not moved:
        return unchanged

    # Rewrite: the tensors not moved go to a new own file, by prepare's layout rule.
    refs = [(ref, ExternalData.of(ref.tensor)) for ref in iter_tensors(model.graph)]
    source = np.memmap(tmp / own_file, dtype=np.uint8, mode="r")
    placed: dict[int, int] = {}
    fd, tmp_weights = create_temp(tmp / own_file)
    try:
        with os.fdopen(fd, "wb") as fh:
            writer = WeightsWriter(fh, manifest)
            for ref, info in refs:
                if info is None or info.location != own_file or info.length is None:
                    continue
                target = moved.get((own_file, info.offset))
                if target is not None:
                    set_external(ref.tensor, target[0], target[1], info.length)
                    continue
                start = placed.get(info.offset)
                if start is None:  # tied tensors stay one copy
                    end = info.offset + info.length
                    start = writer.add(
                        (  # bounded memory
                            source[at : min(at + COPY_CHUNK_BYTES, end)].tobytes()
                            for at in range(info.offset, end, COPY_CHUNK_BYTES)
                        ),
                        info.length,
                    )
                    placed[info.offset] = start
                set_external(ref.tensor, own_file, start, info.length)
            shared = tuple(
                SharedWeights(name, shared_sizes[name], sha[name]) for name in sorted(uses)
            )
            rewritten = writer.finish(tensors=len(placed), shared=shared)
        del source
        if placed:
            os.replace(tmp_weights, tmp / own_file)
            new = rewritten
            sha[own_file] = new.sha256
        else:  # every tensor is another entry's: the first linked file is the main one
            tmp_weights.unlink()
            (tmp / own_file).unlink()
            sha.pop(own_file)
            first, *rest = shared
            new = dataclasses.replace(
                manifest,
                file=first.file,
                size_bytes=first.size_bytes,
                sha256=first.sha256,
                tensors=sum(1 for target in moved.values() if target[0] == first.file),
                shared=tuple(rest),
            )
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_weights.unlink()
        raise
    write_manifest(model, new)
    replace_file(model_path, model.SerializeToString())
    return Dedupe(
        {
            "layout": layout,
            "tensors": _index(model, tmp, new, lendable=True),
            "shared": {"files": uses, "tensors": len(moved), "bytes": shared_bytes},
        },
        sha,
    )
