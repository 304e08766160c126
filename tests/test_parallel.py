"""The engine choice (gptcore/training/parallel.py) and activation checkpointing (gptcore/model/recompute.py),
in-process. The engines themselves train under torchrun in tests/test_fsdp.py."""

import pytest
import torch

from gptcore.config import ConfigError, ModelConfig
from gptcore.distributed import Env
from gptcore.model.gpt import GPT
from gptcore.overrides import load_config
from gptcore.training import parallel


def env(world: int, dtype=torch.float32) -> Env:
    return Env(rank=0, local_rank=0, world=world, device=torch.device("cpu"), dtype=dtype, compile=False)


def test_auto_picks_ddp_where_the_states_fit_a_rank_and_fsdp_where_they_do_not(monkeypatch):
    monkeypatch.setattr(parallel, "device_memory", lambda device: 40 * 2**30)  # a 40 GiB card
    small, large = load_config("gpt2-124m"), load_config("gpt2-1558m")
    p = parallel.plan(small, env(8))
    assert p.kind == "ddp" and "fit a replica" in p.why and "1.9 GiB of 40.0 GiB" in p.why
    p = parallel.plan(large, env(8))
    assert p.kind == "fsdp" and "sharded" in p.why
    assert parallel.plan(large, env(1)).kind == "single"  # one rank: nothing to spread
    large.optim.name = "muon"  # Muon needs whole matrices: auto stays on DDP and says so
    assert parallel.plan(large, env(8)).kind == "ddp"
    small.train.parallel = "fsdp"  # an explicit choice is taken as given
    assert parallel.plan(small, env(8)) == parallel.Plan("fsdp", "train.parallel=fsdp")


def test_hsdp_mesh_across_nodes_and_a_flat_one_on_one_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert parallel.mesh_shape(env(16)) == (2, 8) and parallel.mesh_shape(env(8)) == (8,)
    assert "HSDP: 2 replicas x 8 shards" in parallel.mesh_text("fsdp", env(16))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per node: nothing to shard within a node
    assert parallel.mesh_shape(env(4)) == (4,)


def test_fsdp_refuses_what_it_cannot_shard_and_bad_values_are_named():
    with pytest.raises(ConfigError, match="Muon orthogonalizes whole matrices"):
        load_config("micro", ["train.parallel=fsdp", "optim.name=muon"])
    with pytest.raises(ConfigError, match="fp16 needs a gradient scaler"):
        load_config("micro", ["train.parallel=fsdp", "train.dtype=float16"])
    with pytest.raises(ConfigError, match="train.parallel='zero3'; use auto, ddp or fsdp"):
        load_config("micro", ["train.parallel=zero3"])
    with pytest.raises(ConfigError, match="use none, selective or full"):
        load_config("micro", ["train.activation_checkpointing=some"])


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_recomputes_the_same_loss_and_gradients(mode):
    """With dropout on: recomputation restores the RNG state, so the masks (and every gradient) are the same."""
    def step(recompute):
        torch.manual_seed(0)
        model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1))
        model.recompute = recompute
        x = torch.randint(0, 50257, (4, 17), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        _, loss = model(x[:, :-1], x[:, 1:], return_logits=False)
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    (want, want_grads), (got, got_grads) = step("none"), step(mode)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
