"""No sharedml call that writes a model destroys a file it reads.

Every writer (prepare, prepare_family, compress, compress_static and the CLI) is given a
destination that is, or is another name for, its source model or the source's external data
file: the same path, a hard link, a symlink, a path through a symlinked folder, an existing
folder that resolves to the source's own name, a weights file named like the source's data,
and where the filesystem ignores letter case, the name in other letters. Each must refuse
before writing anything, leaving every source byte and the folders as they were.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml.cli import main
from sharedml.prepared import compress, compress_static

WIDTH = 64
DATA = "model.onnx.data"


def mlp(folder: Path, *, name: str = "model.onnx", data: str = DATA) -> Path:
    """x[N, 64] -> MatMul -> Relu -> MatMul -> [N, 8], weights in the external file ``data``.

    Something every writer accepts: compress quantizes its MatMuls, compress_static too.
    """
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((WIDTH, 8)).astype(np.float32), "w2"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    onnx.save_model(model, str(path), save_as_external_data=True, location=data, size_threshold=0)
    return path


def calibration() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((4, WIDTH)).astype(np.float32)} for _ in range(4)]


def run(path: Path) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": np.ones((2, WIDTH), np.float32)})[0]  # type: ignore[no-any-return]


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root``: a file's bytes, a link's target, a folder's mark."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            found[key] = "dir"
        else:
            found[key] = path.read_bytes()
    return found


# A writer: (source model, destination) -> None, raising where it refuses.
Writer = Callable[[Path, Path], object]


def cli(*args: str) -> None:
    """Run the CLI; its one-line error (exit status 1) raised as a PrepareError."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main([*args])
    lines = err.getvalue().strip().splitlines()
    if status != 0:
        assert status == 1 and len(lines) == 1, lines  # one line, no traceback
        raise sharedml.PrepareError(lines[0])


WRITERS: dict[str, Writer] = {
    "prepare": lambda src, dst: sharedml.prepare(src, dst),
    "compress": lambda src, dst: compress(src, dst, weights="int4"),
    "compress_static": lambda src, dst: compress_static(src, dst, calibration=calibration()),
    "cli prepare": lambda src, dst: cli("prepare", str(src), "-o", str(dst)),
}


def _same_path(src: Path, base: Path) -> Path:
    return src


def _data_file(src: Path, base: Path) -> Path:
    return src.parent / DATA


def _source_folder(src: Path, base: Path) -> Path:
    return src.parent  # an existing folder: <folder>/<src stem>.onnx, the source itself


def _hard_link(src: Path, base: Path) -> Path:
    os.link(src, base / "linked.onnx")
    return base / "linked.onnx"


def _hard_link_to_data(src: Path, base: Path) -> Path:
    os.link(src.parent / DATA, base / "out.weights")
    return base / "out.onnx"  # its weights file, out.weights, is the source's data


def _symlink(src: Path, base: Path) -> Path:
    (base / "link.onnx").symlink_to(src)
    return base / "link.onnx"


def _symlinked_folder(src: Path, base: Path) -> Path:
    (base / "alias").symlink_to(src.parent, target_is_directory=True)
    return base / "alias" / src.name


def _other_case(src: Path, base: Path) -> Path:
    other = src.with_name(src.name.upper())
    if not other.exists():
        pytest.skip("this filesystem tells letter case apart: no other-case name to alias")
    return other


ALIASES: dict[str, Callable[[Path, Path], Path]] = {
    "the same path": _same_path,
    "the external data file": _data_file,
    "the source's folder": _source_folder,
    "a hard link": _hard_link,
    "a weights file hard-linked to the data": _hard_link_to_data,
    "a symlink": _symlink,
    "a symlinked folder": _symlinked_folder,
    "the name in other letters": _other_case,
}


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_no_writer_replaces_its_source_or_anything_aliasing_it(
    tmp_path: Path, writer: str, alias: str
) -> None:
    src = mlp(tmp_path / "src")
    base = tmp_path / "elsewhere"
    base.mkdir()
    dst = ALIASES[alias](src, base)
    if os.name != "posix" and "link" in alias:
        pytest.skip("links need POSIX")
    expected = run(src)
    before = tree(tmp_path)
    with pytest.raises(sharedml.PrepareError, match=r"overwrite its source|only regular files"):
        WRITERS[writer](src, dst)
    assert tree(tmp_path) == before  # nothing written, nothing destroyed, no temporary left
    np.testing.assert_array_equal(run(src), expected)


def test_a_weights_file_named_like_the_source_data_is_refused_by_every_writer(
    tmp_path: Path,
) -> None:
    # The source keeps its weights in out.weights; writing out.onnx would write out.weights.
    src = mlp(tmp_path, name="net.onnx", data="out.weights")
    before = tree(tmp_path)
    for name, write in WRITERS.items():
        with pytest.raises(sharedml.PrepareError, match="external data of the source"):
            write(src, tmp_path / "out.onnx")
        assert tree(tmp_path) == before, name


def test_a_family_member_hard_linked_into_the_output_folder_is_refused(tmp_path: Path) -> None:
    a = mlp(tmp_path / "a", name="a.onnx", data="a.data")
    b = mlp(tmp_path / "b", name="b.onnx", data="b.data")
    out = tmp_path / "out"
    out.mkdir()
    os.link(a, out / "a.onnx")  # the folder's a.onnx is the member itself, under another name
    before = tree(tmp_path)
    with pytest.raises(sharedml.PrepareError, match="overwrite its source"):
        sharedml.prepare_family([a, b], out)
    assert tree(tmp_path) == before
    assert main(["prepare", str(a), str(b), "-o", str(out)]) == 1
    assert tree(tmp_path) == before


def test_inspect_refuses_a_plot_that_would_replace_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = mlp(tmp_path, name="model.png")  # ORT reads a model by content, whatever its name
    before = tree(tmp_path)
    assert main(["inspect", str(src), "--plot", str(src)]) == 1
    err = capsys.readouterr().err
    assert "would overwrite its source" in err and len(err.strip().splitlines()) == 1
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------------------------
# Another user's file at an output, in a sticky folder (/tmp, a shared deploy folder)


def _plant(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o666)  # anyone may read and write it: anyone may hard-link it too


def _refused_in_sticky_folder(src: Path, dst: Path, owner: int) -> None:
    """As the victim: prepare and the CLI refuse, name the owner, and leave nothing behind."""
    folder = dst.parent
    before = tree(folder)
    for attempt in ("library", "cli"):
        try:
            if attempt == "library":
                sharedml.prepare(src, dst)
            else:
                cli("prepare", str(src), "-o", str(dst))
        except sharedml.PrepareError as exc:
            text = str(exc)
            assert f"belongs to user id {owner}" in text and "sticky bit" in text, text
            assert "permissions" not in text, text  # the folder's permissions are not the fault
        else:
            raise AssertionError(f"{attempt}: prepare replaced another user's file")
        # No hard link to the planted file (an '.old' backup) and no temporary file stays.
        assert tree(folder) == before, attempt


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("planted", ["graph", "weights", "both"])
def test_a_prepare_over_another_users_file_in_a_sticky_folder_says_whose_and_leaves_nothing(
    planted: str,
    other_user: Callable[[Callable[[], None]], None],
    second_other_user: Callable[[Callable[[], None]], None],
) -> None:
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="sharedml-sticky-"))
    try:
        os.chmod(base, 0o755)
        src = mlp(base / "src")
        for path in (src, src.parent / DATA):
            os.chmod(path, 0o644)
        deploy = base / "deploy"
        deploy.mkdir()
        os.chmod(deploy, 0o1777)
        names = {"graph": ["model.onnx"], "weights": ["model.weights"]}
        names["both"] = names["graph"] + names["weights"]
        for name in names[planted]:
            other_user(lambda name=name: _plant(deploy / name, b"planted"))  # type: ignore[misc]
        second_other_user(
            lambda: _refused_in_sticky_folder(src, deploy / "model.onnx", other_user.uid)  # type: ignore[attr-defined]
        )
        for name in names[planted]:
            assert (deploy / name).read_bytes() == b"planted"
    finally:
        shutil.rmtree(base)


def _no_backup_link_and_a_clear_rename_error(planted: Path, owner: int) -> None:
    from sharedml.prepared import _files

    # A link this user could not remove again (the sticky bit) is never made.
    assert _files.keep_a_link(planted) is None
    assert sorted(p.name for p in planted.parent.iterdir()) == [planted.name]
    # A file planted after check_outputs looked: the rename's error says whose file it is.
    tmp = _files.write_temp(planted, b"new")
    try:
        with pytest.raises(sharedml.PrepareError, match=f"belongs to user id {owner}"):
            _files.replace_output(tmp, planted)
    finally:
        tmp.unlink()


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_no_backup_link_is_made_of_a_file_a_sticky_folder_keeps(
    other_user: Callable[[Callable[[], None]], None],
    second_other_user: Callable[[Callable[[], None]], None],
) -> None:
    import shutil
    import tempfile

    deploy = Path(tempfile.mkdtemp(prefix="sharedml-sticky-"))
    try:
        os.chmod(deploy, 0o1777)
        planted = deploy / "model.weights"
        other_user(lambda: _plant(planted, b"planted"))
        owner = other_user.uid  # type: ignore[attr-defined]
        second_other_user(lambda: _no_backup_link_and_a_clear_rename_error(planted, owner))
        assert planted.read_bytes() == b"planted"
    finally:
        shutil.rmtree(deploy)


def test_an_empty_output_path_is_refused_not_taken_for_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = mlp(tmp_path / "src")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # Path("") is "." : prepare wrote work/model.onnx here
    for write in (
        lambda: sharedml.prepare(src, ""),
        lambda: sharedml.prepare_family([src], ""),
        lambda: compress(src, "", weights="int4"),
        lambda: compress_static(src, "", calibration=calibration()),
        lambda: cli("prepare", str(src), "-o", ""),
    ):
        with pytest.raises(sharedml.PrepareError, match=r"output (path|folder) is empty"):
            write()
    assert list(work.iterdir()) == []
