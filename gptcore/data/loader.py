"""The training data loader: memory-mapped token shards, deterministically shuffled, resumable.

The train split is cut into non-overlapping windows of T+1 tokens (inputs and shifted targets). Every
epoch has its own permutation, drawn from (seed, epoch): the order of the shards, a random start offset
in each shard (so epochs see different windows) and the order of the windows inside each shard.
Concatenated, that gives ONE global stream of sequences, the same for every world size.

Optimizer step s consumes the N = total_batch_tokens / T sequences [s*N, (s+1)*N) of that stream; rank r
takes micro-batch m as the B sequences starting at s*N + (m*world + r)*B. So each rank reads only its
own part, the sequences of a step are the same whatever the (world, accumulation) split, and the
loader's whole state is one global number (`position`, in sequences), which the checkpoint stores: a
run resumed on a different number of ranks continues the same data order.

Shuffling matters: build-nanogpt's periodic loss bumps came from reading shards in order every epoch.
"""

from __future__ import annotations

import bisect
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from gptcore.data.shard_format import Manifest, ShardError, read_shard
from gptcore.files import file_sha256


def open_dataset(dataset_dir: Path) -> Manifest:
    """Load the manifest and check every shard's header and size (hashes: verify_hashes), so a missing,
    truncated or foreign shard stops the run before training starts."""
    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        raise ShardError(f"dataset directory {dataset_dir} does not exist; run the tokenize stage first "
                         "or point data.dataset_dir at a shard directory")
    manifest = Manifest.load(dataset_dir)
    bad = manifest.verify(dataset_dir)
    if bad:
        raise ShardError(f"dataset {dataset_dir}: shards {bad[:5]}{' ...' if len(bad) > 5 else ''} are "
                         "missing, truncated, of another format or do not match the manifest; re-run the "
                         "tokenize stage to rebuild them")
    if not manifest.split("train"):
        raise ShardError(f"dataset {dataset_dir} has no train shards (only {len(manifest.shards)} val); "
                         "use a larger source or a smaller data.shard_tokens")
    return manifest


def verify_hashes(dataset_dir: Path, manifest: Manifest, cache: Path, why: str = "") -> None:
    """Check every shard's sha256 against the manifest (Manifest.verify_hashes: re-hashed only when a file
    changed, so a nightly restart of a ~20 GB dataset costs stats); ShardError names the first that differs,
    `why` it was not rebuilt, and the repair."""
    bad = manifest.verify_hashes(Path(dataset_dir), cache)
    if bad:
        raise ShardError(f"shard {Path(dataset_dir) / bad[0]} does not match its sha256 in the manifest (damaged or "
                         f"half-copied){f' and was not rebuilt: {why}' if why else ''}. Repair it with `python -m "
                         "gptcore.data.build <preset> --full-verify` (re-cuts only the damaged shards), then run again")


class ShardLoader:
    """Per-rank micro-batches of the global shuffled stream. Call `next_batch()` accum times per step."""

    def __init__(self, dataset_dir: Path, B: int, T: int, total_batch_tokens: int, seed: int,
                 rank: int = 0, world: int = 1, device: torch.device | str = "cpu",
                 manifest: Manifest | None = None, verify_reads: bool = True):
        self.dir = Path(dataset_dir)
        self.manifest = manifest or open_dataset(self.dir)
        self.B, self.T, self.seed, self.rank, self.world = B, T, seed, rank, world
        self.device = torch.device(device)
        if total_batch_tokens % (B * T * world):
            raise ValueError(f"total_batch_tokens={total_batch_tokens} not divisible by B*T*world="
                             f"{B * T * world}")
        self.seqs_per_step = total_batch_tokens // T
        self.accum = self.seqs_per_step // (B * world)
        self.shards = self.manifest.split("train")
        if max(s.tokens for s in self.shards) < T + 1:
            raise ShardError(f"dataset {self.dir}: no train shard holds one sequence of seq_len+1={T + 1} "
                             "tokens; use a smaller train.seq_len or a larger dataset")
        self._tokens: dict[int, np.ndarray] = {}  # shard index -> memmap (opened on first use)
        # small caches (reading crosses few epochs and shards at a time) in front of the two methods
        self._epoch = functools.lru_cache(maxsize=3)(self._epoch)
        self._perm = functools.lru_cache(maxsize=5)(self._perm)
        self._epoch_starts = [0]  # global index where each epoch begins (grown on demand)
        self.position = 0  # global sequence index at the start of the next optimizer step
        self.micro = 0  # micro-batch of the current step handed out so far
        # bit rot: each shard is re-hashed in the background at its first read of every epoch (a flipped
        # byte keeps size, mtime and inode, so the cached check at start-up cannot see it). One loader per
        # node does it (`verify_reads`: the trainer's local rank 0), for every shard the whole step reads on
        # any rank: the ranks of a node read the same files, and 8 hashing ranks would read each shard 8 times
        self.verify_reads = verify_reads
        self._hashed: set[tuple[int, int]] = set()  # (epoch, shard) already submitted
        self._hashes: list[tuple[str, Future]] = []
        self._hasher: ThreadPoolExecutor | None = None

    # --- the global stream ---------------------------------------------------------------------

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard order, start offset per shard, cumulative sequence counts) of epoch e."""
        rng = np.random.default_rng([self.seed, e])
        order = rng.permutation(len(self.shards))
        sizes = np.array([s.tokens for s in self.shards])[order]
        # a fresh offset per epoch so windows do not repeat exactly; only where it costs no window
        slack = (sizes - 1) % self.T
        offsets = np.array([rng.integers(0, k + 1) for k in slack])
        counts = (sizes - 1 - offsets) // self.T
        return order, offsets, np.cumsum(counts)

    def _perm(self, e: int, j: int, n: int) -> np.ndarray:
        """Order of the n windows of the j-th shard of epoch e."""
        return np.random.default_rng([self.seed, e, j]).permutation(n)

    def locate(self, g: int) -> tuple[int, int, int]:
        """Global sequence index -> (epoch, shard index, token start)."""
        starts = self._epoch_starts  # epoch e covers [starts[e], starts[e+1])
        while starts[-1] <= g:
            starts.append(starts[-1] + int(self._epoch(len(starts) - 1)[2][-1]))
        e = bisect.bisect_right(starts, g) - 1
        g -= starts[e]
        order, offsets, cum = self._epoch(e)
        j = bisect.bisect_right(cum, g)
        local = g - (int(cum[j - 1]) if j else 0)
        n = int(cum[j] - (cum[j - 1] if j else 0))
        start = int(offsets[j]) + int(self._perm(e, j, n)[local]) * self.T
        return e, int(order[j]), start

    def sequences(self, g: int, count: int) -> np.ndarray:
        """`count` sequences of T+1 tokens starting at global index g, as an int64 (count, T+1) array."""
        out = np.empty((count, self.T + 1), dtype=np.int64)
        for i in range(count):
            epoch, shard, start = self.locate(g + i)
            if shard not in self._tokens:
                self._tokens[shard] = read_shard(self.dir / self.shards[shard].name)
            out[i] = self._tokens[shard][start:start + self.T + 1]
        return out

    def shards_between(self, g0: int, g1: int) -> list[tuple[int, int]]:
        """The (epoch, shard) pairs that global sequences [g0, g1) are read from, in order."""
        out, g = [], g0
        while g < g1:
            self.locate(g)  # grows the epoch starts to cover g
            e = bisect.bisect_right(self._epoch_starts, g) - 1
            order, _, cum = self._epoch(e)
            j = bisect.bisect_right(cum, g - self._epoch_starts[e])
            out.append((e, int(order[j])))
            g = self._epoch_starts[e] + int(cum[j])  # the next shard's first sequence
        return out

    def _check_in_background(self, epoch: int, shard: int) -> None:
        self._hashed.add((epoch, shard))
        if self._hasher is None:  # one thread: sha256 reads far faster than training consumes tokens
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")
        info = self.shards[shard]
        self._hashes.append((info.name, self._hasher.submit(
            lambda: file_sha256(self.dir / info.name) == info.sha256)))

    def damaged(self) -> list[str]:
        """Shards whose background check has finished since the last call and found bytes that do not
        hash to the manifest's sha256 (or could not be read). Never waits."""
        done = [(name, f) for name, f in self._hashes if f.done()]
        self._hashes = [(name, f) for name, f in self._hashes if not f.done()]
        return [name for name, f in done if f.exception() is not None or not f.result()]

    # --- per rank ------------------------------------------------------------------------------

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch (x, y), each (B, T) int64 on the loader's device."""
        if self.verify_reads and self.micro == 0:  # the shards every rank reads in this step
            for epoch, shard in self.shards_between(self.position, self.position + self.seqs_per_step):
                if (epoch, shard) not in self._hashed:
                    self._check_in_background(epoch, shard)
        g = self.position + (self.micro * self.world + self.rank) * self.B
        buf = torch.from_numpy(self.sequences(g, self.B))
        self.micro += 1
        if self.micro == self.accum:
            self.micro = 0
            self.position += self.seqs_per_step
        if self.device.type == "cuda":
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]

    @property
    def epoch(self) -> int:
        return self.locate(self.position)[0]

    def set_micro_batch(self, B: int) -> None:
        """Split the following steps into micro-batches of B sequences (train.micro_batch=auto after an
        out-of-memory step). Between steps only; each step still covers the same sequences."""
        if self.micro != 0 or self.seqs_per_step % (B * self.world):
            raise ValueError(f"micro-batch {B} mid-step or not a divisor of this rank's share")
        self.B, self.accum = B, self.seqs_per_step // (B * self.world)

    def state_dict(self) -> dict:
        if self.micro != 0:
            raise RuntimeError("loader state saved in the middle of an optimizer step")
        return {"position": self.position, "seed": self.seed, "seq_len": self.T,
                "seqs_per_step": self.seqs_per_step, "manifest_id": self.manifest.id}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("seq_len", self.T), ("manifest_id", self.manifest.id)):
            if state.get(key) != mine:
                raise ValueError(f"loader state was saved with {key}={state.get(key)!r}, this run has "
                                 f"{mine!r}; the global data order would change")
        self.position, self.micro = int(state["position"]), 0


def val_batches(dataset_dir: Path, B: int, T: int, n_tokens: int, rank: int = 0, world: int = 1):
    """Fixed validation batches: the first n_tokens of the val split as (B, T) (x, y) int64 tensors,
    batch i going to rank i % world (the same batches every call, whatever the world size)."""
    dataset_dir = Path(dataset_dir)
    shards = Manifest.load(dataset_dir).split("val")
    if not shards:
        raise ShardError(f"dataset {dataset_dir} has no val shard; re-run the tokenize stage")
    want = max(1, n_tokens // (B * T)) * B * T + 1  # +1: the last target
    parts, have = [], 0
    for s in shards:
        if have < want:
            parts.append(np.asarray(read_shard(dataset_dir / s.name)[: want - have]))
            have += len(parts[-1])
    tokens = np.concatenate(parts)
    n_batches = (len(tokens) - 1) // (B * T)
    if n_batches < 1:
        raise ShardError(f"the val split of {dataset_dir} has {len(tokens)} tokens, fewer than one batch of "
                         f"B*T+1 = {B * T + 1}; use a smaller micro_batch/seq_len or a larger dataset")
    for i in range(rank, n_batches, world):
        buf = torch.from_numpy(tokens[i * B * T: (i + 1) * B * T + 1].astype(np.int64))
        yield buf[:-1].view(B, T), buf[1:].view(B, T)
