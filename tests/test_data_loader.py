import numpy as np
import pytest
import torch

from gptcore.data.loader import ShardLoader, open_dataset, val_batches
from gptcore.data.shard_format import Manifest, ShardError
from tests.test_train_utils import make_dataset

T, B = 16, 2


def windows(loader, g0, n):
    return [tuple(loader.locate(g)[1:]) for g in range(g0, g0 + n)]


def test_each_epoch_is_a_permutation_of_all_windows_and_epochs_differ(ds):
    L = ShardLoader(ds, B, T, B * T * 4, seed=1)
    n = int(L._epoch(0)[2][-1])  # sequences in epoch 0
    expected = sum((s.tokens - 1) // T for s in L.shards)
    assert expected - len(L.shards) <= n <= expected  # a random start offset may cost a window
    e0 = windows(L, 0, n)
    assert len(set(e0)) == n  # no window twice
    assert all(L.locate(g)[0] == 0 for g in range(n)) and L.locate(n)[0] == 1
    for shard, start in e0:
        assert start + T + 1 <= L.shards[shard].tokens
    e1 = windows(L, n, L._epoch_starts[2] - n)
    assert e0 != e1  # reshuffled (and re-offset) every epoch
    # shuffled: not the in-order layout that caused build-nanogpt's periodic loss bumps
    assert e0[: len(e0) // 2] != sorted(e0[: len(e0) // 2])


def test_order_is_deterministic_by_seed(ds):
    a, b, c = (ShardLoader(ds, B, T, B * T * 4, seed=s) for s in (7, 7, 8))
    assert windows(a, 0, 300) == windows(b, 0, 300)
    assert windows(a, 0, 300) != windows(c, 0, 300)
    assert np.array_equal(a.sequences(5, 3), b.sequences(5, 3))


def step_sequences(loaders, accum):
    """All sequences consumed in one optimizer step by a group of rank loaders."""
    rows = [x for _ in range(accum) for L in loaders for x in L.next_batch()[0].tolist()]
    return sorted(map(tuple, rows))


@pytest.mark.parametrize("world", [2, 4])
def test_world_split_reads_the_same_sequences_per_step(ds, world):
    total = B * T * 4
    one = [ShardLoader(ds, B, T, total, seed=3)]
    many = [ShardLoader(ds, B, T, total, seed=3, rank=r, world=world) for r in range(world)]
    for _ in range(150):  # crosses an epoch boundary
        assert step_sequences(one, 4) == step_sequences(many, 4 // world)
    # every rank reads different sequences
    assert one[0].epoch == 1
    x = [L.sequences(L.position + r * B, B) for r, L in enumerate(many)]
    assert not np.array_equal(x[0], x[1])


def test_targets_are_inputs_shifted_by_one(ds):
    L = ShardLoader(ds, B, T, B * T, seed=0)
    x, y = L.next_batch()
    assert x.shape == y.shape == (B, T) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_resume_with_another_world_size_continues_the_global_stream(ds):
    total = B * T * 4
    ref = ShardLoader(ds, B, T, total, seed=5)
    ref_steps = [step_sequences([ref], 4) for _ in range(10)]
    first = [ShardLoader(ds, B, T, total, seed=5, rank=r, world=2) for r in range(2)]
    for _ in range(4):
        step_sequences(first, 2)
    state = first[0].state_dict()
    assert state["position"] == 4 * total // T  # global, in sequences
    resumed = [ShardLoader(ds, B, T, total, seed=5, rank=r, world=4) for r in range(4)]
    for L in resumed:
        L.load_state_dict(state)
    assert [step_sequences(resumed, 1) for _ in range(6)] == ref_steps[4:]


def test_state_from_another_seed_or_seq_len_is_rejected(ds):
    state = ShardLoader(ds, B, T, B * T, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        ShardLoader(ds, B, T, B * T, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        ShardLoader(ds, B, 8, B * 8, seed=1).load_state_dict(state)


def test_val_batches_are_fixed_and_split_by_rank(ds):
    all_ = list(val_batches(ds, B, T, 5 * B * T))
    assert len(all_) == 5
    r0, r1 = list(val_batches(ds, B, T, 5 * B * T, 0, 2)), list(val_batches(ds, B, T, 5 * B * T, 1, 2))
    pairs = zip(r0 + r1, all_[0::2] + all_[1::2], strict=True)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in pairs)
    x, y = all_[0]
    assert torch.equal(x.flatten()[1:], y.flatten()[:-1])


# --- broken datasets: a clear error before training ----------------------------------------------

def test_missing_dataset_dir(tmp_path):
    with pytest.raises(ShardError, match="does not exist"):
        open_dataset(tmp_path / "nope")


def test_missing_or_truncated_shard_is_named(tmp_path):
    d = make_dataset(tmp_path / "a")
    (d / "test_train_000002.bin").unlink()
    with pytest.raises(ShardError, match="test_train_000002.bin"):
        open_dataset(d)
    d = make_dataset(tmp_path / "b")
    p = d / "test_train_000001.bin"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ShardError, match="test_train_000001.bin"):
        open_dataset(d)


def test_shard_of_another_format(tmp_path):
    d = make_dataset(tmp_path / "a")
    p = d / "test_train_000003.bin"
    raw = bytearray(p.read_bytes())
    raw[0:4] = np.int32(20240801).tobytes()  # another tool's magic
    p.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="test_train_000003.bin"):
        open_dataset(d)


def test_manifest_of_another_tokenizer(tmp_path):
    d = make_dataset(tmp_path / "a", tokenizer="cl100k_base")
    with pytest.raises(ShardError, match="tokenizer=cl100k_base"):
        open_dataset(d)


def test_no_train_split(tmp_path):
    d = make_dataset(tmp_path / "a", sizes=(3000,))
    assert Manifest.load(d).split("train") == []
    with pytest.raises(ShardError, match="no train shards"):
        open_dataset(d)


def test_one_loader_per_node_hashes_every_shard_any_rank_reads(ds):
    """Bit-rot checks are one node-wide job: the loader of local rank 0 submits each shard that any rank's
    step reads, once per epoch; the node's other loaders hash nothing (8 ranks used to read every shard 8
    times over)."""
    world, total = 4, B * T * 8
    loaders = [ShardLoader(ds, B, T, total, seed=3, rank=r, world=world, verify_reads=r == 0) for r in range(world)]
    read: set[tuple[int, int]] = set()
    for _ in range(200):  # past an epoch boundary
        for L in loaders:
            for _ in range(L.accum):
                g = L.position + (L.micro * world + L.rank) * B
                read.update((e, s) for e, s, _ in (L.locate(g + i) for i in range(B)))
                L.next_batch()
    assert loaders[0].epoch >= 1
    assert read <= loaders[0]._hashed and len({e for e, _ in read}) >= 2  # every (epoch, shard) any rank read
    assert all(not L._hashed for L in loaders[1:])
    for _, f in loaders[0]._hashes:  # the background checks finish: an intact dataset has no damaged shard
        f.result(timeout=60)
    assert loaders[0].damaged() == []
