#!/usr/bin/env python3
"""Turn a folder of text files into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

Tokenizer (--tokenizer):
  bpe (default)  a byte-level BPE of --vocab-size ids (default 512, what
                 configs/train/cpu_tiny.yaml's model.vocab holds) trained on the corpus itself,
                 offline, and saved beside the dataset as PREFIX.tokenizer.json (a HuggingFace
                 `tokenizers` file) and as the HuggingFace tokenizer folder PREFIX.hf_tokenizer/
                 (that file and a tokenizer_config.json naming the end-of-document token), which
                 Megatron-LM reads with --tokenizer-type HuggingFaceTokenizer --tokenizer-model
                 PREFIX.hf_tokenizer (`transformers` installed)
  FILE.json      an existing HuggingFace `tokenizers` file (e.g. a model's tokenizer.json),
                 kept beside the dataset the same two ways
  bytes          UTF-8 bytes (ids 0-255), id 256 closing each document (model.vocab >= 257)
Every document is closed by the end-of-document id (--eod-token for bpe and FILE.json).
Files are found recursively (--glob, default '*.txt', matched in every subfolder); one document
per file, or per non-empty line with --per-line.

    python tools/build_indexed_dataset.py DIR PREFIX [--tokenizer bpe|bytes|FILE.json]
        [--vocab-size 512] [--glob '*.txt'] [--per-line]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

EOD = 256
"""The end-of-document id of the bytes tokenizer."""
EOD_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB = 512


def encode(text: str) -> np.ndarray:
    """The bytes tokenizer: a document's UTF-8 bytes."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def hf_tokenizer_dir(prefix: str | Path) -> Path:
    """The HuggingFace tokenizer folder kept beside a dataset (AutoTokenizer.from_pretrained and
    Megatron-LM's --tokenizer-type HuggingFaceTokenizer --tokenizer-model read it)."""
    return Path(f"{prefix}.hf_tokenizer")


def save_hf_tokenizer(tok, prefix: str | Path, eod_token: str) -> Path:
    """`tok` (a `tokenizers.Tokenizer`) as a HuggingFace tokenizer folder: its tokenizer.json and
    a tokenizer_config.json whose end-of-sequence token is the end-of-document token (what
    Megatron-LM's tokenizer calls eod)."""
    import json

    out = hf_tokenizer_dir(prefix)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eod_token,
        "model_max_length": 1 << 40,
        "clean_up_tokenization_spaces": False,
    }, indent=1) + "\n")
    return out


def tokenizer_path(prefix: str | Path) -> Path:
    """Where a dataset's BPE tokenizer is kept: beside PREFIX.bin / .idx."""
    return Path(f"{prefix}.tokenizer.json")


def _documents(files: list[Path], per_line: bool):
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if per_line:
            yield from (line for line in text.splitlines() if line.strip())
        elif text:
            yield text


def train_bpe(files: list[Path], per_line: bool, vocab_size: int, eod_token: str = EOD_TOKEN):
    """A byte-level BPE trained on the corpus: every byte has an id (nothing is unknown), then
    the corpus's most frequent merges up to `vocab_size` ids, the end-of-document token first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"--vocab-size must be >= 257 (256 bytes and {eod_token}), got "
                         f"{vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eod_token], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_documents(files, per_line), trainer=trainer)
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # not a tokenizers file
        raise ValueError(f"--tokenizer {path} is not a HuggingFace tokenizers file: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _files(folder: Path, pattern: str) -> list[Path]:
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory")
    found = folder.glob(pattern) if "/" in pattern else folder.rglob(pattern)
    return sorted(f for f in found if f.is_file())


def build(
    folder: str | Path,
    prefix: str | Path,
    pattern: str = "*.txt",
    per_line: bool = False,
    tokenizer: str = "bpe",
    vocab_size: int = DEFAULT_VOCAB,
    eod_token: str = EOD_TOKEN,
) -> int:
    """Write PREFIX.bin/.idx (and PREFIX.tokenizer.json for a BPE); returns the number of
    documents."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    folder, out_dir = Path(folder), Path(prefix).parent
    if not out_dir.is_dir():
        raise ValueError(f"output directory {out_dir} does not exist")
    files = _files(folder, pattern)
    if not files:
        raise ValueError(f"{folder}: no files match {pattern!r} (searched recursively)")
    if tokenizer == "bytes":
        tok, eod, dtype = None, EOD, np.uint16
    else:
        tok = (train_bpe(files, per_line, vocab_size, eod_token) if tokenizer == "bpe"
               else load_tokenizer(tokenizer))
        eod = tok.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"--tokenizer {tokenizer} has no {eod_token!r} token "
                             "(--eod-token names the end-of-document token)")
        dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.int32
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    n, batch = 0, []

    def flush() -> None:
        nonlocal n
        encoded = ([encode(d) for d in batch] if tok is None else
                   [np.asarray(e.ids) for e in tok.encode_batch(batch)])
        for ids in encoded:
            ids = np.concatenate([ids, [eod]]).astype(np.int64)
            if len(ids) < 2:
                continue
            builder.add_item(torch.from_numpy(ids))
            builder.end_document()
            n += 1
        batch.clear()

    for doc in _documents(files, per_line):
        batch.append(doc)
        if len(batch) >= 1024:
            flush()
    flush()
    if n == 0:
        raise ValueError(f"{folder}: the files hold no text")
    builder.finalize(f"{prefix}.idx")
    if tok is not None:  # kept with the data: training checks model.vocab against it
        tok.save(str(tokenizer_path(prefix)))
        save_hf_tokenizer(tok, prefix, eod_token)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("prefix")
    ap.add_argument("--glob", default="*.txt", help="file name pattern, matched recursively")
    ap.add_argument("--per-line", action="store_true", help="one document per non-empty line")
    ap.add_argument("--tokenizer", default="bpe", help="bpe (trained here), bytes, or FILE.json")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                    help="ids of the trained BPE (--tokenizer bpe)")
    ap.add_argument("--eod-token", default=EOD_TOKEN, help="the end-of-document token")
    args = ap.parse_args(argv)
    try:
        n = build(args.folder, args.prefix, args.glob, args.per_line, args.tokenizer,
                  args.vocab_size, args.eod_token)
    except ValueError as e:
        print(f"build_indexed_dataset: error: {e}", file=sys.stderr)
        return 2
    extra = "" if args.tokenizer == "bytes" else (
        f", tokenizer {tokenizer_path(args.prefix)} (and the HuggingFace folder "
        f"{hf_tokenizer_dir(args.prefix)})")
    print(f"wrote {args.prefix}.bin / .idx with {n} documents{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
