import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from gptcore.checkpoints import checkpoint as C
from gptcore.checkpoints import run_files as R
from gptcore.metrics import JsonlLogger, read_metrics
from gptcore.model.gpt import GPT
from gptcore.presets import model_preset
from tests.test_train_utils import free_port


def trained_model(seed=0):
    torch.manual_seed(seed)
    m = GPT(model_preset("micro"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randint(0, 50257, (2, 16))
    m(x, x)[1].backward()
    opt.step()
    return m, opt


def save(run, step, m, opt, val=None, keep=2):
    state = {"optimizer": opt.state_dict(), "loader": {"position": step * 8}, "step": step,
             "rng": [{"torch": torch.get_rng_state()}], "scaler": {}}
    return C.save_checkpoint(run, step, m, state, {"val_loss": val, "run_name": "t"}, keep_last=keep)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_roundtrip_tied_weight_stored_once(tmp_path):
    m, opt = trained_model()
    ck = save(tmp_path, 7, m, opt)
    assert ck.name == "step_00000007" and sorted(p.name for p in ck.iterdir()) == \
        ["meta.json", "model.safetensors", "trainer.pt"]
    stored = load_file(ck / "model.safetensors")
    assert "transformer.wte.weight" in stored and "lm_head.weight" not in stored
    rng = torch.random.get_rng_state()
    loaded, meta = C.load_model(ck)
    # no random init drawn only to be overwritten (1.6 s a load at gpt2's size): the generator is untouched
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert same_weights(m, loaded)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    assert meta["step"] == 7 and meta["model_config"]["n_layer"] == 2 and len(meta["model_sha256"]) == 64


def test_wrapped_models_save_clean_keys(tmp_path):
    m, opt = trained_model()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(torch.compile(m))  # module._orig_mod.*
        assert any(k.startswith("module._orig_mod.") for k in wrapped.state_dict())
        ck = save(tmp_path, 1, wrapped, opt)
    finally:
        dist.destroy_process_group()
    keys = load_file(ck / "model.safetensors").keys()
    assert not [k for k in keys if k.startswith(("module.", "_orig_mod."))]
    assert same_weights(m, C.load_model(ck)[0])


def test_trainer_state_loads_with_weights_only(tmp_path):
    m, opt = trained_model()
    rng = torch.get_rng_state()
    ck = save(tmp_path, 3, m, opt)
    state = torch.load(ck / "trainer.pt", weights_only=True)  # no pickled code needed
    opt2 = torch.optim.AdamW(GPT(model_preset("micro")).parameters(), lr=1e-3)
    opt2.load_state_dict(state["optimizer"])
    exp = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], exp)
    assert state["loader"] == {"position": 24} and torch.equal(state["rng"][0]["torch"], rng)


def test_retention_keeps_last_k_and_best(tmp_path):
    m, opt = trained_model()
    for step, val in [(10, 3.0), (20, 2.0), (30, 2.5), (40, None), (50, 2.9)]:
        save(tmp_path, step, m, opt, val=val, keep=2)
    names = [p.name for p in R.list_checkpoints(tmp_path)]
    assert names == ["step_00000020", "step_00000040", "step_00000050"]
    assert R.best_checkpoint(tmp_path).name == "step_00000020"
    assert R.latest_checkpoint(tmp_path).name == "step_00000050"
    assert R.read_meta(R.best_checkpoint(tmp_path))["val_loss"] == 2.0


def test_best_falls_back_to_latest_and_empty_run(tmp_path):
    assert R.latest_checkpoint(tmp_path) is None and R.best_checkpoint(tmp_path) is None
    m, opt = trained_model()
    save(tmp_path, 1, m, opt)
    save(tmp_path, 2, m, opt)
    assert R.best_checkpoint(tmp_path).name == "step_00000002"


def test_failed_write_leaves_previous_checkpoints_untouched(tmp_path, monkeypatch):
    m, opt = trained_model()
    save(tmp_path, 5, m, opt)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(C.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 10, m, opt)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000005"]  # no temp left


def test_saving_the_same_step_again_replaces_it(tmp_path):
    m, opt = trained_model()
    save(tmp_path, 5, m, opt, val=4.0)
    m2, opt2 = trained_model(seed=1)
    save(tmp_path, 5, m2, opt2, val=3.0)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000005"]
    loaded, meta = C.load_model(R.latest_checkpoint(tmp_path))
    assert meta["val_loss"] == 3.0 and same_weights(m2, loaded)


def test_partial_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step_00000009-123").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000009").mkdir()  # no meta.json: never completed
    assert R.list_checkpoints(tmp_path) == []


def test_a_killed_writers_temp_dir_is_removed_by_the_next_save(tmp_path):
    """SIGKILL mid-save leaves a full-size temp dir (1.5 GB at 124M); the next save removes it, but not
    a live writer's or another host's (shared storage)."""
    import subprocess

    from gptcore.files import _HOST

    proc = subprocess.Popen(["true"])  # a pid that has exited
    proc.wait()
    ckdir = tmp_path / "checkpoints"
    stale = ckdir / f".step_00000009.tmp-{_HOST}-{proc.pid}"
    live = ckdir / f".step_00000011.tmp-{_HOST}-{os.getpid()}"
    other = ckdir / f".step_00000012.tmp-otherhost-{proc.pid}"
    trash = ckdir / f".step_00000002.del.tmp-{_HOST}-{proc.pid}"  # retention killed mid-delete
    for d in (stale, live, other, trash):
        (d / "sub").mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    m, opt = trained_model()
    save(tmp_path, 10, m, opt)
    assert not stale.exists() and not trash.exists() and live.is_dir() and other.is_dir()
    assert [p.name for p in R.list_checkpoints(tmp_path)] == ["step_00000010"]


def test_load_errors_are_clear(tmp_path):
    m, opt = trained_model()
    ck = save(tmp_path, 1, m, opt)
    big = GPT(model_preset("tiny-cpu"))
    with pytest.raises(R.CheckpointError, match="another model shape"):
        C.load_weights(big, ck / "model.safetensors")
    with pytest.raises(R.CheckpointError, match="not a checkpoint"):
        C.load_model(tmp_path)
    data = bytearray((ck / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (ck / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(R.CheckpointError, match="corrupt"):
        C.load_model(ck)
    (ck / "trainer.pt").unlink()
    with pytest.raises(R.CheckpointError, match="cannot resume"):
        C.load_trainer_state(ck)


def test_jsonl_logger_appends_and_survives_a_torn_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    log = JsonlLogger(p)
    log.log(1, {"train/loss": torch.tensor(2.5), "train/lr": 1e-3})
    log.log(1, {"text": "hi"}, kind="sample")
    log.close()
    with open(p, "a") as f:
        f.write('{"step": 2, "ti')  # SIGKILL mid-line
    log = JsonlLogger(p)
    log.log(3, {"val/loss": float("nan")}, kind="eval")
    log.close()
    rows = read_metrics(p)
    assert [(r["step"], r["kind"]) for r in rows] == [(1, "train"), (1, "sample"), (3, "eval")]
    assert rows[0]["train/loss"] == 2.5 and rows[2]["val/loss"] is None
    for line in p.read_text().splitlines()[:2]:
        assert set(json.loads(line)) >= {"step", "time", "kind"}


def test_background_saves_stage_into_one_buffer_allocated_once(tmp_path):
    """The copy every save blocks training for goes into one exactly-sized buffer per part (weights,
    trainer state), allocated by the first save and reused by the next; what is written is the state
    of its own step, and trainer.pt holds no copy of the weights (a view's whole storage is what
    torch.save writes)."""
    from gptcore.checkpoints.background import ALIGN, Checkpointer

    m, opt = trained_model()
    ck = Checkpointer(tmp_path, keep_last=3)
    state = lambda: {"optimizer": opt.state_dict(), "step": 1, "loader": {}, "scaler": {},  # noqa: E731
                     "rng": [{"torch": torch.get_rng_state()}, {"torch": torch.get_rng_state()}]}
    ck.save(1, C.weights_of(m), state(), {"run_name": "t"})
    ck.close()
    out = ck.outcome(wait=True)
    assert out.status == "written", out.text
    flat = ck._weights.flats[torch.float32]
    weights = C.weights_of(m)
    step = ALIGN // 4
    assert list(ck._weights.flats) == [torch.float32]
    assert flat.numel() == sum(-(-v.numel() // step) * step for v in weights.values())
    before = {k: v.clone() for k, v in weights.items()}
    x = torch.randint(0, 50257, (2, 16))
    m(x, x)[1].backward()
    opt.step()  # the weights move on between the two saves
    ck.save(2, C.weights_of(m), state(), {"run_name": "t"})
    ck.close()
    assert ck._weights.flats[torch.float32].data_ptr() == flat.data_ptr()  # reused, not allocated again
    first, second = (load_file(str(R.step_dir(tmp_path, s) / C.MODEL_FILE)) for s in (1, 2))
    assert all(torch.equal(first[k], before[k]) for k in before)
    assert all(torch.equal(second[k], v) for k, v in C.weights_of(m).items())
    assert not all(torch.equal(first[k], second[k]) for k in first)
    weight_bytes = sum(v.numel() * v.element_size() for v in weights.values())
    assert (R.step_dir(tmp_path, 2) / C.TRAINER_FILE).stat().st_size < 2.2 * weight_bytes  # AdamW's 2 moments
    # rank 1's RNG state is a view in the middle of the buffer: restoring it must not crash the process
    # (torch.set_rng_state segfaults on such a view; resume.restore clones it)
    from gptcore.distributed import Env
    from gptcore.training.resume import restore

    ts = C.load_trainer_state(R.step_dir(tmp_path, 2))
    assert ts["rng"][1]["torch"].storage_offset() > 0
    env = Env(rank=1, local_rank=1, world=2, device=torch.device("cpu"), dtype=torch.float32, compile=False,
              loss="plain")
    assert restore(ts, opt, None, None, env, data=False) == 1


def test_a_sharded_step_is_written_whole_verified_per_file_loaded_anywhere_and_consolidated(tmp_path):
    """FSDP2's checkpoint path in one process on one gloo rank (tests/test_fsdp.py runs it on 2 ranks under
    torchrun): the step holds shards/ + trainer.pt + meta.json with every file's sha256; a plain model and
    its optimizer read it without a process group; its consolidation equals the sharded weights bitwise
    and is reused; a shard with a NaN writes nothing; a rotted shard and another model shape are named."""
    from dataclasses import asdict, replace

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gptcore.checkpoints import sharded
    from gptcore.checkpoints.background import SKIPPED, WRITTEN, Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        m, opt = trained_model()
        mesh = init_device_mesh("cpu", (1,))
        for block in m.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)  # of the sharded parameters, with state
        x = torch.randint(0, 50257, (2, 16))
        m(x, x)[1].backward()
        opt.step()
        full = StateDictOptions(full_state_dict=True)
        weights, moments = get_model_state_dict(m, options=full), get_optimizer_state_dict(m, opt, options=full)
        ck = Checkpointer(tmp_path, keep_last=3)

        def save_step(step):
            staged = ck.staging_dir(step)
            ck.save_sharded(step, sharded.start_save(staged, m, opt, None), staged,
                            {"loader": {"position": step}, "step": step, "rng": [], "scaler": {}},
                            {"run_name": "t", "model_config": asdict(m.config)}, master=True)
            return ck.outcome(wait=True), staged

        out, staged = save_step(4)
        step = R.step_dir(tmp_path, 4)
        assert out.status == WRITTEN and out.text == str(step) and not staged.exists()
        meta = R.read_meta(step)
        assert meta["format"] == "sharded" and sorted(meta["shards_sha256"]) == [".metadata", "__0_0.distcp"]
        assert sorted(p.name for p in step.iterdir()) == ["meta.json", "shards", "trainer.pt"]

        plain = GPT(model_preset("micro"))
        state = C.load_for_resume(step, plain)[1]
        assert state["optimizer_shards"] == str(step) and state["loader"] == {"position": 4}
        assert all(torch.equal(v, weights[k]) for k, v in plain.state_dict().items())
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        sharded.load_optimizer(plain, plain_opt, step)
        got = get_optimizer_state_dict(plain, plain_opt)["state"]
        assert got.keys() == moments["state"].keys() and all(
            torch.equal(got[k]["exp_avg_sq"], moments["state"][k]["exp_avg_sq"]) for k in got)

        whole = C.consolidate(step)
        assert whole == step / R.CONSOLIDATED_DIR and R.read_meta(whole)["model_sha256"] == \
            C.file_sha256(whole / C.MODEL_FILE)
        registered = load_file(whole / C.MODEL_FILE)
        assert all(torch.equal(v, weights[k]) for k, v in registered.items())
        written = (whole / C.MODEL_FILE).stat().st_mtime_ns
        assert C.consolidate(step) == whole and (whole / C.MODEL_FILE).stat().st_mtime_ns == written  # reused

        with torch.no_grad():  # a NaN in the (only) rank's shard: the step is not written
            next(m.parameters()).to_local()[0] = float("nan")
        out, staged = save_step(8)
        assert out.status == SKIPPED and "non-finite" in out.text
        assert not R.step_dir(tmp_path, 8).exists() and not staged.exists()

        other = GPT(replace(m.config, n_embd=64))
        with pytest.raises(R.CheckpointError, match="does not fit this model.*shape mismatch"):
            C.load_for_resume(step, other)
        shard = step / "shards" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(R.CheckpointError, match="shards/__0_0.distcp does not match the sha256"):
            C.load_for_resume(step, plain)
    finally:
        dist.destroy_process_group()


def test_a_whole_checkpoint_loads_into_a_sharded_model_and_its_optimizer(tmp_path):
    """ddp -> fsdp: a whole step (written by DDP or one rank) goes into an FSDP2 model's shards, weights
    and AdamW moments both (parallel.load_optimizer), in one process on one gloo rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gptcore.training import parallel

    plain, plain_opt = trained_model(seed=1)
    ck = save(tmp_path, 3, plain, plain_opt)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(2)  # other weights than the checkpoint's
        m = GPT(model_preset("micro"))
        mesh = init_device_mesh("cpu", (1,))
        for block in m.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        state = C.load_for_resume(ck, m, load=False)[1]  # what rank 0 checks before every rank loads
        C.load_into(m, ck)
        parallel.load_optimizer(m, opt, state["optimizer"])
        full = StateDictOptions(full_state_dict=True)
        got = get_model_state_dict(m, options=full)
        assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items())
        moments = get_optimizer_state_dict(m, opt, options=full)["state"]
        want = get_optimizer_state_dict(plain, plain_opt, options=full)["state"]
        assert moments.keys() == want.keys() and all(
            torch.equal(moments[k]["exp_avg"], want[k]["exp_avg"]) for k in want)
    finally:
        dist.destroy_process_group()
