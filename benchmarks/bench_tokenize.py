"""Tokenize-and-shard throughput and memory vs. the machine's real ceiling and a naive baseline.

    python -m benchmarks.bench_tokenize [--tokens 100e6] [--rounds 3] [--workers N] [--prefect] [--smoke]

Corpus: the built-in corpus repeated to >= --tokens tokens, as one local parquet file. 100M tokens (~4
minutes for 3 rounds here) is 1% of FineWeb-Edu 10BT, large enough that the stage's fixed costs (start-up,
fork, the last piece and shard, the manifest: ~0.2 s) weigh as little as they do on a real dataset; at
20M tokens they are ~8% of a 2 s run.
Methods, each in a fresh subprocess, interleaved over rounds (the machine is shared; medians are
reported). Timed runs go without the memory sampler; peak RSS comes from one more run of each:
  ideal   the ceiling: tiktoken's numpy encoder over all documents on ONE thread (texts in memory,
          nothing else), its rate times the core count, i.e. perfect linear scaling over cores
  batch   tiktoken encode_ordinary_batch on all cores (texts in memory; builds Python int lists under
          the GIL, so it is a baseline, not a limit)
  naive   build-nanogpt fineweb.py style: multiprocessing.Pool(cores).imap(tokenize one doc), fill a
          shard buffer, write shards (no hashing, no atomic rename, no resume)
  stage   gptcore.data.build.run: plan pieces, tokenize them on a process pool, cut shards (sha256,
          atomic writes, manifest; shards are cut while later pieces are still tokenized), i.e.
          `python -m gptcore.data.build`
  prefect (--prefect) the same through the Prefect `tokenize` flow (ProcessPoolTaskRunner) on a
          throwaway local `prefect server`: its difference to `stage` is Prefect's overhead
Overheads measured on their own: parquet read, EOT/uint16 assembly, sha256, shard writing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks import parse_args

ROOT = Path(__file__).resolve().parents[1]
SHARD_TOKENS = 2_000_000  # 10 shards for 20M tokens: writing and hashing show up if they cost anything
PIECE_BYTES = 2_000_000  # ~30 pieces for 20M tokens: 2 workers stay evenly loaded to the end
# --smoke: one copy of the built-in corpus (~1.6M tokens), still cut into several shards and pieces
SMOKE = {"tokens": 1, "rounds": 1, "shard_tokens": 200_000, "piece_bytes": 500_000}


def build_corpus(path: Path, min_tokens: float) -> tuple[int, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gptcore.data.source_builtin import BUILTIN
    from gptcore.model.tokenizer import get_encoding

    texts = pq.read_table(BUILTIN, columns=["text"]).column("text").to_pylist()
    per = sum(len(t) for t in get_encoding().encode_ordinary_batch(texts)) + len(texts)
    reps = int(np.ceil(min_tokens / per))
    pq.write_table(pa.table({"text": texts * reps}), path, row_group_size=8, compression="zstd")
    return reps * per, reps * len(texts)


class TreeRSS:
    """Peak total RSS of this process and all its descendants (pool workers, forkserver children),
    sampled from /proc every 20 ms: RUSAGE_CHILDREN misses grandchildren and un-reaped workers."""

    def __init__(self):
        import threading
        self.peak, self.stop = 0, False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    @staticmethod
    def _tree_rss() -> int:
        """Resident memory of this process and every process below it (psutil)."""
        root, total = psutil.Process(), 0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a worker that exited between the listing and the read
                total += proc.memory_info().rss
        return total

    def _loop(self):
        while not self.stop:
            self.peak = max(self.peak, self._tree_rss())
            time.sleep(0.02)

    def close(self) -> float:
        # not ru_maxrss: Linux carries it over exec from the parent (here the benchmark that built the
        # corpus), so every method would report at least the parent's peak
        self.stop = True
        self.thread.join()
        return round(self.peak / 2**20, 1)


# --- the methods (run in a subprocess each) --------------------------------------------------------

def m_ideal(corpus: Path, out: Path, workers: int) -> int:
    import pyarrow.parquet as pq

    from gptcore.model.tokenizer import get_encoding
    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()
    enc = get_encoding()
    enc.encode_to_numpy("warm up")
    t0 = time.perf_counter()
    n = sum(enc.encode_to_numpy(t, disallowed_special=()).size for t in texts) + len(texts)
    dt = time.perf_counter() - t0
    return n, dt / (os.cpu_count() or 1)  # linear scaling over every core: nothing can do better


def m_batch(corpus: Path, out: Path, workers: int) -> int:
    import pyarrow.parquet as pq

    from gptcore.model.tokenizer import get_encoding
    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()
    enc = get_encoding()
    enc.encode_ordinary("warm up")
    t0 = time.perf_counter()
    ids = enc.encode_ordinary_batch(texts, num_threads=os.cpu_count())
    dt = time.perf_counter() - t0
    return sum(len(x) for x in ids) + len(texts), dt


def _naive_tokenize(text):
    from gptcore.model.tokenizer import EOT, get_encoding
    return np.array([EOT, *get_encoding().encode_ordinary(text)], dtype=np.uint16)


def m_naive(corpus: Path, out: Path, workers: int):
    import multiprocessing as mp

    import pyarrow.parquet as pq

    from gptcore.data.shard_format import shard_header
    t0 = time.perf_counter()
    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()
    out.mkdir(parents=True, exist_ok=True)
    buf, n, idx, total = np.empty(SHARD_TOKENS, dtype=np.uint16), 0, 0, 0
    with mp.get_context("fork").Pool(workers) as pool:  # fineweb.py: Pool(nprocs), imap(chunksize=16)
        for toks in pool.imap(_naive_tokenize, texts, chunksize=16):
            total += len(toks)
            while len(toks):
                take = min(SHARD_TOKENS - n, len(toks))
                buf[n: n + take], n, toks = toks[:take], n + take, toks[take:]
                if n == SHARD_TOKENS:
                    (out / f"naive_{idx:06d}.bin").write_bytes(shard_header(n) + buf.tobytes())
                    idx, n = idx + 1, 0
    if n:
        (out / f"naive_{idx:06d}.bin").write_bytes(shard_header(n) + buf[:n].tobytes())
    return total, time.perf_counter() - t0


def _stage_cfg(corpus: Path, workers: int):
    from gptcore.overrides import load_config
    return load_config("micro", [f"data.source={corpus}", f"data.shard_tokens={SHARD_TOKENS}",
                                 f"data.piece_bytes={PIECE_BYTES}", f"data.num_workers={workers}"])


def m_stage(corpus: Path, out: Path, workers: int):
    os.environ["GPTPIPE_HOME"] = str(out)
    from gptcore.data import build
    cfg = _stage_cfg(corpus, workers)
    t0 = time.perf_counter()
    m = build.run(cfg, workers=workers)
    return m.total_tokens(), time.perf_counter() - t0


def m_prefect(corpus: Path, out: Path, workers: int):
    os.environ["GPTPIPE_HOME"] = str(out)
    from flows.dataset import tokenize_dataset
    from gptcore.data import location
    cfg = _stage_cfg(corpus, workers)
    t0 = time.perf_counter()
    tokenize_dataset(cfg)
    dt = time.perf_counter() - t0
    from gptcore.data.shard_format import Manifest
    return Manifest.load(location.dataset_dir(cfg)).total_tokens(), dt


METHODS = {"ideal": m_ideal, "batch": m_batch, "naive": m_naive, "stage": m_stage, "prefect": m_prefect}
TARGETS = {"ideal": 0.85, "naive": 1.0}  # the stage's wall-time rate against these, medians of round ratios


def one(method: str, corpus: Path, out: Path, workers: int, rss: bool) -> None:
    # The RSS sampler costs ~1 ms of CPU per 20 ms sample: on a busy machine that is taken from the
    # workers of a multi-process method but from an idle core for the one-thread ideal, so timed runs go
    # without it and peak memory is measured in a separate run of each method.
    sampler = TreeRSS() if rss else None
    cpu0 = _cpu_s()
    tokens, dt = METHODS[method](corpus, out, workers)
    cpu = _cpu_s() - cpu0  # also counts setup outside the timed region (e.g. loading texts): upper bound
    print(json.dumps({"method": method, "tokens": tokens, "seconds": dt, "tok_s": tokens / dt,
                      "rss_mb": sampler.close() if sampler else None, "tok_per_cpu_s": tokens / cpu}))


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (pool workers): robust to a busy machine."""
    me, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + ch.ru_utime + ch.ru_stime


def run_one(method, corpus, out, workers, env=None, rss=False) -> dict:
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_tokenize", "--one", method, "--corpus",
                        str(corpus), "--out", str(out), "--workers", str(workers), "--shard-tokens",
                        str(SHARD_TOKENS), "--piece-bytes", str(PIECE_BYTES), *(["--rss"] if rss else [])],
                       cwd=ROOT,
                       capture_output=True, text=True, env=env or os.environ.copy())
    if r.returncode:
        raise SystemExit(f"{method} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --- overheads, measured alone --------------------------------------------------------------------

def overheads(corpus: Path, tmp: Path, tokens: int) -> dict:
    import pyarrow.parquet as pq

    from gptcore.data.shard_format import write_shard_chunks
    from gptcore.data.tokenizing import join_documents
    res = {}
    t0 = time.perf_counter()
    n = 0
    for rb in pq.ParquetFile(corpus).iter_batches(batch_size=512, columns=["text"], use_threads=False):
        n += sum(len(t) for t in rb.column(0).to_pylist())
    res["parquet_read_s"] = time.perf_counter() - t0
    toks = np.random.default_rng(0).integers(0, 50257, tokens, dtype=np.uint16)
    t0 = time.perf_counter()
    hashlib.sha256(memoryview(toks).cast("B")).hexdigest()
    res["sha256_s (once over all tokens)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, tokens, SHARD_TOKENS):
        write_shard_chunks(tmp / f"w{i}.bin", [toks[i: i + SHARD_TOKENS]], len(toks[i: i + SHARD_TOKENS]))
    res["write_shards_s (atomic+fsync+sha256)"] = time.perf_counter() - t0
    arrays = [toks[i: i + 30000].astype(np.uint32) for i in range(0, tokens, 30000)]  # as tiktoken returns
    t0 = time.perf_counter()
    join_documents(arrays)
    res["eot_assembly_s"] = time.perf_counter() - t0
    return {k: round(v, 3) for k, v in res.items()}


def _prefect_server(home: Path):
    import socket
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db"}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api"
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{api}/health", timeout=1)
            return proc, {**env, "PREFECT_API_URL": api}
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("prefect server did not start")


def main(argv: list[str] | None = None) -> None:
    global SHARD_TOKENS, PIECE_BYTES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=100e6, help="at least this many (whole copies of the "
                    "built-in corpus)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    ap.add_argument("--piece-bytes", type=int, default=PIECE_BYTES)
    ap.add_argument("--prefect", action="store_true", help="also time the Prefect flow (starts a server)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--rss", action="store_true", help=argparse.SUPPRESS)
    a = parse_args(ap, argv, SMOKE)
    SHARD_TOKENS, PIECE_BYTES = a.shard_tokens, a.piece_bytes  # read by the methods and the overheads
    if a.one:
        return one(a.one, Path(a.corpus), Path(a.out), a.workers, a.rss)

    with tempfile.TemporaryDirectory(prefix="bench_tok_") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.parquet"
        tokens, docs = build_corpus(corpus, a.tokens)
        print(f"corpus: {docs} documents, {tokens / 1e6:.1f}M tokens, {corpus.stat().st_size / 1e6:.1f} MB "
              f"parquet; {a.workers} workers on {os.cpu_count()} cores; shard_tokens={SHARD_TOKENS:,}, "
              f"piece_bytes={PIECE_BYTES:,}", flush=True)
        methods = ["ideal", "batch", "naive", "stage"]
        server = None
        if a.prefect:
            server, penv = _prefect_server(tmp / "prefect")
            methods.append("prefect")
        rows: dict[str, list[dict]] = {m: [] for m in methods}
        try:
            for r in range(a.rounds):
                for m in methods:
                    out = tmp / f"{m}{r}"
                    rows[m].append(run_one(m, corpus, out, a.workers, penv if m == "prefect" else None))
                    print(f"  round {r} {m:8s} {rows[m][-1]['tok_s'] / 1e6:6.2f}M tok/s "
                          f"({rows[m][-1]['seconds']:.2f}s)", flush=True)
                # same bytes from the naive baseline and the stage (a correctness cross-check)
                nb = b"".join(p.read_bytes()[1024:] for p in sorted((tmp / f"naive{r}").glob("*.bin")))
                stage_dir = tmp / f"stage{r}"
                sb = b"".join(p.read_bytes()[1024:] for p in sorted(stage_dir.rglob("*_val_*.bin")) +
                              sorted(stage_dir.rglob("*_train_*.bin")))
                assert nb == sb, "naive baseline and stage produced different tokens"
                for m in methods:
                    if m not in ("ideal", "batch"):
                        subprocess.run(["rm", "-rf", str(tmp / f"{m}{r}")])
            rss = {}  # peak memory: one more run of each method, with the sampler (not timed)
            for m in methods:
                rss[m] = run_one(m, corpus, tmp / f"{m}-rss", a.workers, penv if m == "prefect" else None,
                                 rss=True)["rss_mb"]
                subprocess.run(["rm", "-rf", str(tmp / f"{m}-rss")])
        finally:
            if server:
                server.terminate()
                server.wait()
        med = {m: statistics.median(x["tok_s"] for x in rows[m]) for m in methods}
        ratios = {m: [rows[m][i]["tok_s"] / rows["ideal"][i]["tok_s"] for i in range(a.rounds)] for m in methods}
        print("\nmethod    median wall tok/s  vs ideal: median (min-max of rounds)  tok/CPU-s  "
              "peak RSS (process tree)")
        for m in methods:
            cpu = statistics.median(x["tok_per_cpu_s"] for x in rows[m])
            r = ratios[m]
            print(f"{m:8s}  {med[m] / 1e6:8.2f}M          {statistics.median(r):5.2f}x ({min(r):.2f}-{max(r):.2f})"
                  f"                 {cpu / 1e6:6.2f}M   {rss[m]:7.0f} MB")
        vs_naive = [rows["stage"][i]["tok_s"] / rows["naive"][i]["tok_s"] for i in range(a.rounds)]
        print(f"stage vs naive (wall): {statistics.median(vs_naive):.2f}x ({min(vs_naive):.2f}-{max(vs_naive):.2f})")
        got = {"ideal": statistics.median(ratios["stage"]), "naive": statistics.median(vs_naive)}
        missed = [f"{k} ({got[k]:.2f}x < {t}x)" for k, t in TARGETS.items() if got[k] < t]
        print("targets (stage >= 0.85x ideal, >= 1.0x naive, wall time):",
              "met" if not missed else "MISSED: " + ", ".join(missed))
        if a.prefect:
            extra = statistics.median(rows["prefect"][i]["seconds"] - rows["stage"][i]["seconds"]
                                      for i in range(a.rounds))
            print(f"Prefect overhead (flow - stage wall time): {extra:.2f}s per run")
        print("overheads measured alone:", json.dumps(overheads(corpus, tmp, int(tokens))))


if __name__ == "__main__":
    main()
