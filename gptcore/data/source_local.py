"""The local source kind: any data.source that names no other kind is a local directory (searched
recursively), a file or a glob of files in a format formats.py reads. The files are used in place (not
copied) and fingerprinted (size, mtime, sha256; re-hashed only when size or mtime changed), so a changed,
added or removed file is noticed and the dataset rebuilt from it."""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

from gptcore.config import RunConfig
from gptcore.data.formats import SourceError, kind_of, readable_suffixes
from gptcore.data.source_kind import SourceFile, SourceKind, changes, previous_files, safe_name
from gptcore.files import file_sha256


class Local(SourceKind):
    name = "local"
    in_place = True

    def matches(self, source: str) -> bool:
        return True  # asked last: whatever no other kind claims is a path

    def validate(self, cfg: RunConfig) -> None:
        local_files(cfg.data.source, fingerprint=False)  # lists the files only

    def source_id(self, cfg: RunConfig) -> str:
        d = cfg.data
        spec = str(Path(d.source).expanduser().resolve()) if not glob.has_magic(d.source) else d.source
        base = Path(d.source.rstrip("/*")).name or "local"
        return safe_name(f"local-{base}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}")

    def fetch(self, cfg: RunConfig, source_dir: Path) -> list[SourceFile]:
        return local_files(cfg.data.source, previous_files(source_dir))

    def changed(self, cfg: RunConfig, recorded: dict, source_dir: Path) -> str | None:
        return changes(recorded, local_files(cfg.data.source, previous_files(source_dir)), cfg.data.max_docs)


def local_files(spec: str, previous: list[SourceFile] = (), fingerprint: bool = True) -> list[SourceFile]:
    """The source files `spec` names, checked readable, in path order; with `fingerprint`, each with its
    sha256 (taken from `previous` when name, size and mtime are unchanged, else hashed now)."""
    known = {f.name: f for f in previous}
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        paths, root = [Path(p) for p in glob.glob(str(path), recursive=True)], None
    elif path.is_dir():
        paths, root = [p for p in path.rglob("*") if p.is_file()], path
    elif path.is_file():
        paths, root = [path], path.parent
    else:
        raise SourceError(f"data.source={spec!r} does not exist; use 'builtin', 'hf', or an existing "
                          f"directory / glob of {readable_suffixes()} files")
    paths = [p.absolute() for p in paths if p.is_file() and kind_of(p)]
    if not paths:
        raise SourceError(f"data.source={spec!r} holds no {readable_suffixes()} files; point it at a "
                          "directory or glob that matches some")
    # names relative to the source directory; for a glob, to its matches' common folder, so two files with
    # one base name in different folders keep apart (their fingerprints would otherwise collide)
    root = root.absolute() if root is not None else Path(os.path.commonpath([p.parent for p in paths]))
    files = []
    for p in sorted(paths, key=Path.resolve):
        name, p = str(p.relative_to(root)), p.resolve()
        if not os.access(p, os.R_OK):
            raise SourceError(f"source file {p} is not readable (permission denied); fix its permissions")
        st = p.stat()
        f = SourceFile(path=str(p), kind=kind_of(p), size=st.st_size, mtime_ns=st.st_mtime_ns, name=name)
        if fingerprint:
            old = known.get(name)
            same = old is not None and old.sha256 and (old.size, old.mtime_ns) == (f.size, f.mtime_ns)
            f.sha256 = old.sha256 if same else file_sha256(p)
        files.append(f)
    if all(f.size == 0 for f in files):
        raise SourceError(f"data.source={spec!r}: all {len(files)} files are empty; nothing to tokenize")
    return files
