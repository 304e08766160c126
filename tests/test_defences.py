"""The trainer's defence policies in-process, on made-up observations: stragglers and replica disagreement
(gptcore/training/replicas.py), shards that rot mid-run (gptcore/training/damage.py). The same defences in
real torchrun jobs, with the trouble injected: tests/test_faults.py."""

from __future__ import annotations

import json

import pytest

from gptcore.training.damage import DamagedShards
from gptcore.training.replicas import Disagreements, ReplicasDisagree, Stragglers
from gptcore.training.train import EXIT_REPLICAS, fail

HOSTS = ["host-a", "host-b", "host-c"]


def recorder(events: list):
    """An EventLog stand-in: (step, text, who, values) per event."""
    return lambda step, text, who="guard", **values: events.append((step, text, who, values))


def test_a_straggler_is_named_once_per_streak_after_logs_slow_log_steps():
    events: list = []
    stragglers = Stragglers(ratio=1.3, logs=3, hosts=HOSTS, event=recorder(events))
    slow, even = [1.0, 2.0, 1.0], [1.0, 1.1, 1.0]
    assert stragglers.observe(1, slow) == {"straggler/slowest_s": 2.0, "straggler/slowest_rank": 1,
                                           "straggler/median_s": 1.0}
    stragglers.observe(2, slow)
    assert events == []  # two log steps in a row: not yet
    stragglers.observe(3, slow)
    assert events == [(3, "straggler: rank 1 on host host-b computed 2000.0 ms per step, 2.00x the median "
                          "1000.0 ms, at 3 log steps in a row; every rank waits for it in each all-reduce "
                          "(check that host's GPU clocks, temperature and neighbours)",
                       "guard", {"straggler/rank": 1, "straggler/ratio": 2.0})]
    for step in (4, 5, 6):
        stragglers.observe(step, slow)
    assert len(events) == 1  # once per streak, however long
    stragglers.observe(7, even)  # under the ratio: the streak ends
    for step in (8, 9, 10):
        stragglers.observe(step, slow)
    assert [e[0] for e in events] == [3, 10]  # a new streak is named again
    # each rank has its own streak: two ranks slow by turns never reach 3 log steps in a row
    for step in range(11, 17):
        stragglers.observe(step, [2.0, 1.0, 1.0] if step % 2 else [1.0, 1.0, 2.0])
    assert len(events) == 2


def test_a_single_process_has_no_stragglers_and_no_metrics_row():
    events: list = []
    stragglers = Stragglers(ratio=1.3, logs=1, hosts=["host-a"], event=recorder(events))
    assert stragglers.observe(1, [5.0]) == {} and events == []


def test_a_replica_that_differs_rolls_back_once_and_raises_the_second_time():
    events: list = []
    replicas = Disagreements(HOSTS, recorder(events))
    assert replicas.check(4, [7, 7, 7]) is False and events == []
    assert replicas.check(6, [7, 7, 9]) is True  # the caller rolls back
    assert events == [(6, "replicas disagree at step 6: the weights of rank 2 on host host-c differ from the "
                          "majority (checksums [7, 7, 9]); rolling back", "guard", {"guard/replica_mismatch": 1})]
    assert replicas.check(8, [5, 7, 7]) is True  # another rank's first: a rollback too
    with pytest.raises(ReplicasDisagree) as raised:
        replicas.check(12, [7, 7, 8])
    text = str(raised.value)
    assert text.startswith("the replicas' weights differ again at step 12 (rank 2 on host host-c);")
    assert "drain host(s) host-c " in text and len(events) == 2  # no event, no rollback: the run stops
    assert fail(raised.value) == EXIT_REPLICAS  # exit 4, wherever the exception lives


def test_two_replicas_that_disagree_are_both_odd():
    events: list = []
    replicas = Disagreements(HOSTS[:2], recorder(events))
    assert replicas.check(3, [1, 2]) is True
    assert "the weights of rank 0 on host host-a, rank 1 on host host-b differ from each other" in events[0][1]
    assert events[0][3] == {"guard/replica_mismatch": 2}
    with pytest.raises(ReplicasDisagree, match=r"drain host\(s\) host-a, host-b "):
        replicas.check(5, [1, 3])


def test_hsdp_compares_each_shard_with_its_replicas_only(monkeypatch):
    """HSDP on 2 nodes x 2 ranks: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1 (their checksums differ
    and must); a flip on rank 3 makes shard 1's replicas disagree, and nothing else."""
    from gptcore.distributed import Env
    from gptcore.training.parallel import replica_groups

    env = Env(rank=0, local_rank=0, world=4, device=None, dtype=None, compile=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one node: pure FSDP, no two ranks hold the same tensors
    assert replica_groups("fsdp", env) == [] and replica_groups("ddp", env) == [[0, 1, 2, 3]]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    groups = replica_groups("fsdp", env)
    assert groups == [[0, 2], [1, 3]]
    events: list = []
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    replicas = Disagreements(hosts, recorder(events))
    assert replicas.check(2, [10, 20, 10, 20], groups) is False and events == []  # shards differ: as they must
    assert replicas.check(4, [10, 20, 10, 21], groups) is True
    assert events[0][1] == ("replicas disagree at step 4: the weights of rank 1 on host node-a, rank 3 on host "
                            "node-b differ from each other (checksums [10, 20, 10, 21]); rolling back")
    assert replicas.check(6, [10, 20, 10, 20], groups) is False


def test_a_damaged_shard_is_named_once_and_leaves_the_hash_caches(tmp_path):
    caches = [tmp_path / "dataset_hashes.json", tmp_path / "run_hashes.json"]
    for cache in caches:
        cache.write_text(json.dumps({"a.bin": ["h-a"], "b.bin": ["h-b"], "c.bin": ["h-c"]}))
    events: list = []
    damaged = DamagedShards(HOSTS[:2], caches, recorder(events))
    damaged.report(5, [[], []])
    assert events == []
    damaged.report(6, [["a.bin"], ["a.bin", "b.bin"]])  # both ranks found a.bin: one event
    assert [(e[0], e[2]) for e in events] == [(6, "data"), (6, "data")]
    assert events[0][1].startswith("shard a.bin (read by rank 0 on host host-a) no longer matches its sha256 in "
                                   "the manifest: its bytes changed on disk or in memory without a new size or "
                                   "mtime (bit rot). This run goes on with it;")
    assert events[1][1].startswith("shard b.bin (read by rank 1 on host host-b) ")
    for cache in caches:  # the next start and the next data stage re-hash them, and rebuild
        assert json.loads(cache.read_text()) == {"c.bin": ["h-c"]}
    damaged.report(7, [["b.bin"], []])  # found again in a later epoch: already named
    assert len(events) == 2


def test_only_the_rank_given_the_caches_writes_them(tmp_path):
    cache = tmp_path / "hashes.json"
    cache.write_text(json.dumps({"a.bin": ["h-a"]}))
    events: list = []
    DamagedShards(HOSTS[:2], [], recorder(events)).report(3, [[], ["a.bin"]])  # rank 1's view: no caches
    assert len(events) == 1 and json.loads(cache.read_text()) == {"a.bin": ["h-a"]}
    missing = tmp_path / "no_cache_yet.json"
    DamagedShards(HOSTS[:1], [missing], recorder(events)).report(3, [["a.bin"]])
    assert not missing.exists()  # nothing to forget: no file made
