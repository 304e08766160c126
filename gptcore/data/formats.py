"""How documents are read out of a source file: one entry per file format (FORMATS, at the end), so a new
format is one entry here and nothing else branches on it.

    kind = kind_of("data/train-0.jsonl.gz")        # "jsonl.gz"; None for a file this pipeline cannot read
    fmt = FORMATS[...]                              # via file_format(kind)
    fmt.ranges(...)                                 # planning: cut a file into pieces of ~piece_bytes
    read_texts(path, kind, start, stop, column)     # streaming batches of one piece's documents
    fmt.copy_prefix(...)                            # a smoke run: the first documents of a remote file

A document is a parquet row's or a JSON object's `data.text_column` field, or a whole .txt file. A .json
file holds JSON Lines or one top-level array of objects, as `datasets`' json builder reads it. A .gz, .bz2
or .xz file is decompressed as it is read; a compressed file is one piece (a compressed stream cannot be
cut at byte offsets), so parallelism comes from having several files, as hub datasets do.
"""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
import lzma
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gptcore.files import atomic_write_bytes

# (start, stop, documents or -1 when not counted, estimated text bytes): one piece of a file.
Range = tuple[int, int, int, int]
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# A compressed file's text is estimated at this many times its size (plans pieces and the disk check);
# web text compresses about 3-4x with gzip.
COMPRESSED_TEXT_RATIO = 4


class SourceError(RuntimeError):
    """The source is missing, empty, unreadable or lacks the text column; the message says the fix."""


@dataclass
class ReadOptions:
    text_column: str
    batch_docs: int = 512
    strict_utf8: bool = False
    replaced: list[int] = field(default_factory=list)  # a .txt file's invalid UTF-8 sequences, per file


@dataclass(frozen=True)
class FileFormat:
    """How one file format is planned, read and copied in part. `opener` opens the file's bytes (plain or
    decompressing); `compressed` says whether byte offsets of the file are offsets of its text."""
    name: str
    suffix: str
    compressible: bool  # may be wrapped in .gz / .bz2 / .xz
    # (path, opener, compressed, piece_bytes, text_column, count documents?) -> the file's pieces
    ranges: Callable[[Path, Callable, bool, int, str, bool], list[Range]]
    read: Callable[[Path, Callable, int, int, ReadOptions], Iterator[list[str]]]
    copy_prefix: Callable[[object, Path, int, str], int]  # open remote text stream, local file, want, column


def kind_of(path: str | Path) -> str | None:
    """The kind source.json records for a file, from its name: a format's name, plus the compression suffix
    (e.g. "jsonl.gz"); None for a file this pipeline does not read."""
    p = Path(path)
    compression = p.suffix if p.suffix in COMPRESSIONS else ""
    fmt = FORMATS.get(Path(p.name.removesuffix(compression)).suffix)
    if fmt is None or (compression and not fmt.compressible):
        return None
    return fmt.name + compression


def file_format(kind: str) -> tuple[FileFormat, Callable, bool]:
    """The format of a recorded kind, the function that opens its bytes, and whether it is compressed."""
    base, _, compression = kind.partition(".")
    fmt = FORMATS["." + base]
    if compression:
        return fmt, COMPRESSIONS["." + compression], True
    return fmt, lambda path: open(path, "rb"), False


def readable_suffixes() -> str:
    plain = ", ".join(FORMATS)
    return f"{plain} (json, jsonl and txt also as {', '.join(COMPRESSIONS)})"


def read_texts(path: Path, kind: str, start: int, stop: int, text_column: str, limit: int = -1,
               batch_docs: int = 512, strict_utf8: bool = False, replaced: list | None = None):
    """Yield lists of document texts from one piece of a file: for parquet the row groups [start, stop), for
    an uncompressed JSON Lines file the bytes [start, stop) (line-aligned), else the whole file. At most
    `limit` documents (-1 = all). Memory stays at about one batch (a JSON array or a .txt file is read
    whole). A .txt file's replaced invalid UTF-8 sequences are appended to `replaced`."""
    path = Path(path)
    fmt, opener, compressed = file_format(kind)
    if compressed:  # one piece per file: its recorded stop is the compressed size, not a text offset
        start, stop = 0, float("inf")
    opts = ReadOptions(text_column, batch_docs, strict_utf8, replaced if replaced is not None else [])
    left = limit if limit >= 0 else float("inf")
    if left <= 0:
        return
    try:
        for texts in fmt.read(path, opener, start, stop, opts):
            yield texts[: int(min(len(texts), left))]
            left -= len(texts)
            if left <= 0:
                return
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise SourceError(f"cannot read source file {path}: {e}; check it exists, is readable and (if "
                          "compressed) is complete: a hub file is re-downloaded on the next run") from e


# --- parquet --------------------------------------------------------------------------------------

def parquet_text_column(path, text_column: str) -> pq.ParquetFile:
    """Open a parquet file (a path or an open file) and check it has a string text column, with errors
    that name the fix."""
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"cannot read parquet file {path}: {e}. It is corrupt or not parquet; delete or "
                          "replace it (a hub file is re-downloaded on the next run)") from e
    schema = pf.schema_arrow
    if text_column not in schema.names:
        raise SourceError(f"{path} has no column {text_column!r} (columns: {schema.names}); set "
                          f"data.text_column to the one holding the text")
    typ = schema.field(text_column).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise SourceError(f"column {text_column!r} of {path} is {typ}, not text; set data.text_column")
    return pf


def _parquet_ranges(path, opener, compressed, piece_bytes, text_column, count) -> list[Range]:
    """Consecutive row groups of ~piece_bytes (uncompressed) each; the footer gives the document counts."""
    meta = parquet_text_column(path, text_column).metadata
    ranges, start, rows, nbytes = [], 0, 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        rows, nbytes = rows + rg.num_rows, nbytes + rg.total_byte_size
        if nbytes >= piece_bytes or g == meta.num_row_groups - 1:
            ranges.append((start, g + 1, rows, nbytes))
            start, rows, nbytes = g + 1, 0, 0
    return ranges


def _parquet_read(path, opener, start, stop, opts: ReadOptions):
    pf = parquet_text_column(path, opts.text_column)
    for rb in pf.iter_batches(batch_size=opts.batch_docs, row_groups=range(start, stop),
                              columns=[opts.text_column], use_threads=False):
        yield [t or "" for t in rb.column(0).to_pylist()]


def _parquet_prefix(remote_file, local: Path, want: int, text_column: str) -> int:
    """The first `want` rows: each read_row_group fetches only that row group's byte range."""
    pf = parquet_text_column(remote_file, text_column)
    tables, n = [], 0
    for g in range(pf.num_row_groups):
        tables.append(pf.read_row_group(g, columns=[text_column]))
        n += tables[-1].num_rows
        if n >= want:
            break
    table = pa.concat_tables(tables).slice(0, want)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(local, [sink.getvalue().to_pybytes()])
    return table.num_rows


# --- JSON: JSON Lines, or one array of objects ----------------------------------------------------

def _text_of(doc, column: str, where: str, check_surrogates: bool) -> str:
    if not isinstance(doc, dict) or column not in doc:
        keys = list(doc) if isinstance(doc, dict) else type(doc).__name__
        raise SourceError(f"{where}: no field {column!r} (has {keys}); set data.text_column to the field "
                          "holding the text")
    text = doc[column]
    if text is not None and not isinstance(text, str):
        raise SourceError(f"{where}: field {column!r} is a {type(text).__name__}, not a string; fix it or set "
                          "data.text_column")
    if text and check_surrogates:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise SourceError(f"{where}: field {column!r} holds a lone UTF-16 surrogate escape (e.g. \\ud800), "
                              "which is not text; fix it") from None
    return text or ""


def _is_array(path, opener) -> bool:
    """Whether a .json file is one top-level array (else JSON Lines): its first non-blank byte is '['."""
    with opener(path) as fh:
        while chunk := fh.read(4096):
            if stripped := chunk.lstrip():
                return stripped[:1] == b"["
    return False


def json_lines(path, opener, start: int, stop: int):
    """(byte offset in the text, line) of each non-blank line (= document) in [start, stop)."""
    with opener(path) as fh:
        if start:
            fh.seek(start)
        pos = start
        while pos < stop and (line := fh.readline()):
            at, pos = pos, pos + len(line)
            if line.strip():
                yield at, line


def _line_cuts(path: Path, piece_bytes: int) -> list[int]:
    """Line-aligned byte offsets cutting an uncompressed file into ~piece_bytes ranges (deterministic)."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as fh:
        while cuts[-1] + piece_bytes < size:
            fh.seek(cuts[-1] + piece_bytes)
            fh.readline()  # move to the start of the next line
            if fh.tell() >= size:
                break
            cuts.append(fh.tell())
    return cuts + [size]


def _jsonl_ranges(path, opener, compressed, piece_bytes, text_column, count) -> list[Range]:
    if compressed:  # one piece: its documents counted only when a cap needs them
        size = Path(path).stat().st_size
        n = sum(1 for _ in json_lines(path, opener, 0, float("inf"))) if count else -1
        return [(0, size, n, size * COMPRESSED_TEXT_RATIO)]
    cuts = _line_cuts(Path(path), piece_bytes)
    return [(a, b, sum(1 for _ in json_lines(path, opener, a, b)) if count else -1, b - a)
            for a, b in itertools.pairwise(cuts)]


def _jsonl_read(path, opener, start, stop, opts: ReadOptions):
    batch = []
    for at, line in json_lines(path, opener, start, stop):
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise SourceError(f"{path} at byte {at}: not valid JSON ({e}); fix or remove that line") from e
        # only a JSON escape can make a lone surrogate, so the check runs on lines holding one
        batch.append(_text_of(doc, opts.text_column, f"{path} at byte {at}", b"\\u" in line))
        if len(batch) == opts.batch_docs:
            yield batch
            batch = []
    if batch:
        yield batch


def _jsonl_prefix(remote_text, local: Path, want: int, text_column: str) -> int:
    lines = []
    for line in remote_text:  # buffered reads: a smoke run fetches about the bytes of its documents
        if line.strip():
            lines.append(line)
        if len(lines) >= want:
            break
    atomic_write_bytes(local, lines)
    return len(lines)


def _array_docs(path, opener) -> list:
    with opener(path) as fh:
        try:
            docs = json.load(fh)
        except ValueError as e:
            raise SourceError(f"{path} is not valid JSON ({e}); fix or replace it") from e
    if not isinstance(docs, list):
        raise SourceError(f"{path} holds a JSON {type(docs).__name__}, not an array of objects or JSON Lines; "
                          "convert it to JSON Lines (one object per line)")
    return docs


def _json_ranges(path, opener, compressed, piece_bytes, text_column, count) -> list[Range]:
    if not _is_array(path, opener):
        return _jsonl_ranges(path, opener, compressed, piece_bytes, text_column, count)
    size = Path(path).stat().st_size
    n = len(_array_docs(path, opener)) if count else -1
    return [(0, size, n, size * (COMPRESSED_TEXT_RATIO if compressed else 1))]


def _json_read(path, opener, start, stop, opts: ReadOptions):
    if not _is_array(path, opener):
        yield from _jsonl_read(path, opener, start, stop, opts)
        return
    docs = _array_docs(path, opener)
    for i in range(0, len(docs), opts.batch_docs):
        yield [_text_of(d, opts.text_column, f"{path} item {j}", True)
               for j, d in enumerate(docs[i:i + opts.batch_docs], start=i)]


def _json_prefix(remote_text, local: Path, want: int, text_column: str) -> int:
    """The first documents of a JSON Lines file line by line; an array is read whole (it has no lines to
    stop at) and its first documents written as a JSON array."""
    first = b""
    for first in remote_text:
        if first.strip():
            break
    if first.lstrip()[:1] != b"[":
        return _jsonl_prefix(itertools.chain([first], remote_text), local, want, text_column)
    try:
        docs = json.loads(first + remote_text.read())[:want]
    except (ValueError, TypeError) as e:
        raise SourceError(f"{local.name} is not a JSON array or JSON Lines ({e}); convert it to JSON Lines") from e
    atomic_write_bytes(local, [json.dumps(docs).encode()])
    return len(docs)


# --- plain text: a whole file is one document -----------------------------------------------------

def decode_txt(data: bytes, path: Path, strict: bool) -> tuple[str, int]:
    """A .txt file's text and how many invalid UTF-8 sequences were replaced by U+FFFD (SourceError
    instead, with `strict`)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if strict:
            raise SourceError(f"{path} is not valid UTF-8 (first bad byte at offset {e.start}); convert it to "
                              "UTF-8, or set data.strict_utf8=false to replace invalid bytes") from None
    text = data.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - data.count("\ufffd".encode())


def _txt_ranges(path, opener, compressed, piece_bytes, text_column, count) -> list[Range]:
    size = Path(path).stat().st_size
    return [(0, size, 1, size * (COMPRESSED_TEXT_RATIO if compressed else 1))]


def _txt_read(path, opener, start, stop, opts: ReadOptions):
    with opener(path) as fh:
        text, n_bad = decode_txt(fh.read(), path, opts.strict_utf8)
    opts.replaced.append(n_bad)
    yield [text]


def _txt_prefix(remote_text, local: Path, want: int, text_column: str) -> int:
    atomic_write_bytes(local, [remote_text.read()])
    return 1


# --- the table ------------------------------------------------------------------------------------

FORMATS = {f.suffix: f for f in (
    FileFormat("parquet", ".parquet", False, _parquet_ranges, _parquet_read, _parquet_prefix),
    FileFormat("jsonl", ".jsonl", True, _jsonl_ranges, _jsonl_read, _jsonl_prefix),
    FileFormat("json", ".json", True, _json_ranges, _json_read, _json_prefix),
    FileFormat("txt", ".txt", True, _txt_ranges, _txt_read, _txt_prefix),
)}
