"""Every python block of README.md and docs/*.md runs as printed, or says why it cannot.

The blocks run as scripts, in file order, in one fresh process (each block its own
``__main__``, as ``python block.py`` would run it) whose folder holds what they name: a small
MLP at ``model.onnx`` (input ``input``: float32[batch, 64]), ``feeds.npz`` and ``tiny.hex``.
The line before a block may say how to run it::

    <!-- snippet: skip (why it cannot run here: a GPU, a Ray cluster, the reader's data) -->
    <!-- snippet: needs MODULE ... -->   (skipped, saying so, where a module is not installed)
    <!-- snippet: args A B ... -->       (run alone, in its own process, with these arguments)
    <!-- snippet: serve -->              (run alone, with ``sharedml serve model.onnx`` listening
                                          on its documented ports, 8000 and 8001, meanwhile)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"^(?:<!-- snippet: (?P<directive>[^\n]*) -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S
)
_DIRECTIVE = re.compile(
    r"skip \((?P<why>.*\S.*)\)|needs(?P<needs>( [\w.]+)+)|args(?P<args>( \S+)+)|(?P<serve>serve)"
)
_TIMEOUT_S = 600  # every block at once, on a busy 2-core machine


@dataclass(frozen=True)
class Block:
    """A python block of a markdown file, and how the line before it says to run it."""

    doc: str
    line: int
    code: str
    directive: str | None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def script(self) -> str:
        """The file name it runs as: where it is, readable in a traceback."""
        return re.sub(r"\W", "_", Path(self.doc).with_suffix("").as_posix()) + f"_{self.line}.py"

    def how(self) -> re.Match[str] | None:
        return None if self.directive is None else _DIRECTIVE.fullmatch(self.directive)

    def skipped_because(self) -> str | None:
        how = self.how()
        if how is None:
            return None
        if how["why"]:
            return how["why"]
        if how["needs"]:
            missing = [m for m in how["needs"].split() if importlib.util.find_spec(m) is None]
            return f"needs {', '.join(missing)}, not installed" if missing else None
        return None

    def args(self) -> list[str] | None:
        how = self.how()
        return None if how is None or not how["args"] else how["args"].split()

    @property
    def served(self) -> bool:
        """Whether it is a client of ``sharedml serve model.onnx``."""
        how = self.how()
        return how is not None and bool(how["serve"])


def _blocks(doc: str) -> list[Block]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [
        Block(doc, text.count("\n", 0, m.start("code")), m["code"], m["directive"])
        for m in _BLOCK.finditer(text)
    ]


BLOCKS = [block for doc in DOCS for block in _blocks(doc)]


def _mlp(path: Path) -> None:
    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal(s).astype(np.float32) / 8 for s in ((64, 64), (64, 16)))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["output"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


_RUNNER = r"""
import json, runpy, sys, traceback
results = {}
for script in sys.argv[2:]:
    try:
        runpy.run_path(script, run_name="__main__")
        results[script] = None
    except BaseException:  # SystemExit too: a block that exits did not run as printed
        results[script] = traceback.format_exc()
with open(sys.argv[1], "w") as fh:
    json.dump(results, fh)
"""


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Each block that ran: its traceback, or None where it ran through."""
    from sharedml.inspection._child import warmup_model_bytes

    folder = tmp_path_factory.mktemp("docs")
    _mlp(folder / "model.onnx")
    np.savez(folder / "feeds.npz", input=np.ones((1, 64), np.float32))
    (folder / "tiny.hex").write_text(warmup_model_bytes().hex())
    env = {**os.environ, "SHAREDML_CACHE_DIR": str(folder / "cache")}
    run = [b for b in BLOCKS if (b.directive is None or b.how()) and not b.skipped_because()]
    for block in run:
        (folder / block.script).write_text(block.code, encoding="utf-8")
    together = [b for b in run if b.args() is None and not b.served]
    out: dict[str, str | None] = {}
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, "results.json", *(b.script for b in together)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((folder / "results.json").read_text())
    out.update({b.where: results[b.script] for b in together})
    for block in run:
        if (args := block.args()) is not None:
            alone = subprocess.run(
                [sys.executable, block.script, *args],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S,
            )
            out[block.where] = None if alone.returncode == 0 else alone.stderr[-3000:]
    for block in run:
        if block.served:
            out[block.where] = _run_served(block, folder, env)
    return out


def _run_served(block: Block, folder: Path, env: dict[str, str]) -> str | None:
    """Run ``block`` while ``sharedml serve model.onnx`` listens on its default ports."""
    server = subprocess.Popen(
        [sys.executable, "-m", "sharedml", "serve", "model.onnx"],
        cwd=folder,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        lines: list[str] = []
        while not lines or "HTTP on" not in lines[-1]:
            line = server.stderr.readline()
            if not line:
                return "sharedml serve model.onnx did not start:\n" + "\n".join(lines)
            lines.append(line.rstrip())
        client = subprocess.run(
            [sys.executable, block.script],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        return None if client.returncode == 0 else client.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(60)
        if server.stderr is not None:
            server.stderr.close()


def test_every_block_that_does_not_simply_run_says_how_or_why() -> None:
    assert BLOCKS, "no python block found"
    unreadable = [f"{b.where}: {b.directive}" for b in BLOCKS if b.directive and not b.how()]
    assert unreadable == [], "write skip (why), needs MODULE or args A B"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_a_python_block_of_the_docs_runs_as_printed(
    block: Block, failures: dict[str, str | None]
) -> None:
    if block.directive is not None and not block.how():
        pytest.fail(f"{block.where}: unreadable directive {block.directive!r}")
    if (why := block.skipped_because()) is not None:
        pytest.skip(f"{block.where}: {why}")
    assert failures[block.where] is None, f"{block.where}:\n{failures[block.where]}"
