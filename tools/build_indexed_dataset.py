#!/usr/bin/env python3
"""Turn a folder of text files into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

Tokenizer: UTF-8 bytes (ids 0-255) with id 256 closing every document; it needs no download,
so it works offline, and `model.vocab` >= 257 covers it. One document per file (or per
non-empty line with --per-line).

    python tools/build_indexed_dataset.py DIR PREFIX [--glob '*.txt'] [--per-line]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

EOD = 256


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def build(
    folder: str | Path, prefix: str | Path, pattern: str = "*.txt", per_line: bool = False
) -> int:
    """Write PREFIX.bin/.idx; returns the number of documents."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    files = sorted(Path(folder).glob(pattern))
    if not files:
        raise ValueError(f"{folder}: no files match {pattern!r}")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    n = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        docs = [line for line in text.splitlines() if line.strip()] if per_line else [text]
        for doc in docs:
            ids = np.concatenate([encode(doc), [EOD]]).astype(np.uint16)
            if len(ids) < 2:
                continue
            builder.add_item(torch.from_numpy(ids.astype(np.int64)))
            builder.end_document()
            n += 1
    if n == 0:
        raise ValueError(f"{folder}: the files hold no text")
    builder.finalize(f"{prefix}.idx")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("prefix")
    ap.add_argument("--glob", default="*.txt")
    ap.add_argument("--per-line", action="store_true", help="one document per non-empty line")
    args = ap.parse_args(argv)
    try:
        n = build(args.folder, args.prefix, args.glob, args.per_line)
    except ValueError as e:
        print(f"build_indexed_dataset: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.prefix}.bin / .idx with {n} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
