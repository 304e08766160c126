"""The "builtin" source kind: the small public-domain corpus shipped in the package (Shakespeare's 42 works,
one document per work, ~1.6M tokens), checked against its sha256: the offline demo's and the tests' text."""

from __future__ import annotations

from pathlib import Path

from gptcore.config import RunConfig
from gptcore.data.formats import SourceError
from gptcore.data.source_kind import SourceFile, SourceKind
from gptcore.files import file_sha256

BUILTIN = Path(__file__).parents[1] / "assets" / "corpus" / "shakespeare.parquet"
BUILTIN_SHA256 = "2db4ec02cd015044806362430773d64ca4be9030c573aa55d0afe047b3e76c7c"


class Builtin(SourceKind):
    name = "builtin"

    def source_id(self, cfg: RunConfig) -> str:
        return "builtin"

    def dataset_base(self, cfg: RunConfig) -> str:
        return "shakespeare"

    def fetch(self, cfg: RunConfig, source_dir: Path) -> list[SourceFile]:
        return [builtin_file()]

    def changed(self, cfg: RunConfig, recorded: dict, source_dir: Path) -> str | None:
        return None  # fixed by its sha256

    def lineage(self, recorded: dict, dataset_dir: Path) -> tuple[str, dict]:
        return "local", {"uri": str(BUILTIN)}


def builtin_file() -> SourceFile:
    if not BUILTIN.is_file():
        raise SourceError(f"the built-in corpus {BUILTIN} is missing; reinstall the package "
                          "(pip install -e .)")
    if file_sha256(BUILTIN) != BUILTIN_SHA256:
        raise SourceError(f"the built-in corpus {BUILTIN} is corrupted (sha256 mismatch); reinstall the "
                          "package or rebuild it with gptcore/assets/corpus/build_corpus.py")
    st = BUILTIN.stat()
    return SourceFile(path=str(BUILTIN), kind="parquet", size=st.st_size, sha256=BUILTIN_SHA256,
                      mtime_ns=st.st_mtime_ns, name="shakespeare.parquet")
