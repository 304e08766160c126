"""train.micro_batch = "auto": the largest micro-batch that fits this device, found by trying.

The preset's 64 x 1024 is build-nanogpt's micro-batch for an 80 GB card; on a 40 GB A100 or a 24 GB card
its first step runs out of memory. The data order does not depend on the micro-batch (gptcore/data/
loader.py: a step covers the same sequences whatever the split), so it can be chosen per device: gradient
accumulation makes up the rest, and the trajectory is the same up to float summation order (llm-foundry's
`device_train_microbatch_size: auto` does the same).

Before the first step each rank tries the divisors of its share of the batch (sequences per rank per step),
largest first and at most train.micro_batch_max, with one full step of what trains: the DDP-wrapped model
(its gradient buckets are real allocations; `no_sync`, so no collective runs and a rank that runs out of
memory leaves no other waiting), forward and backward at the real dtype and loss (compiled when the run
compiles), then the real optimizer's step with its state held throughout, at learning rate 0 on zeroed
gradients so that no weight moves. A size that runs out of memory, or on CUDA peaks within MARGIN of the
card, is freed and the next one tried; the ranks adopt the smallest answer. The choice is
kept in <run_dir>/micro_batch.json for this hardware and settings, so a nightly resume does not probe again.
A step that still runs out of memory later (fragmentation, a longer evaluation before it) is retried with
the same data at the next smaller size (`retry_smaller`, which the trainer calls).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import asdict

import torch

from gptcore import distributed
from gptcore.checkpoints.run_files import MICRO_BATCH_FILE
from gptcore.config import RunConfig
from gptcore.files import read_json, write_json
from gptcore.model.tokenizer import N_VOCAB
from gptcore.training import parallel
from gptcore.training.resume import RunError

AUTO = "auto"
CHOICE_FILE = MICRO_BATCH_FILE
MARGIN = 0.10  # of the card's memory a chosen size leaves free at its step's peak


class NothingFits(RuntimeError):
    """Not even a micro-batch of one sequence fits the device."""


def share(cfg: RunConfig, world: int) -> int:
    """Sequences per rank per optimizer step: what the micro-batches of one step add up to."""
    return cfg.train.total_batch_tokens // (cfg.train.seq_len * world)


def candidates(n: int, cap: int) -> list[int]:
    """The micro-batches that divide a share of n sequences, at most `cap`, largest first."""
    return [d for d in range(min(n, cap), 0, -1) if n % d == 0]


def smaller(micro: int, n: int) -> int | None:
    """The next micro-batch to try after `micro` ran out of memory: the largest divisor of n at most half
    of it (halving, as llm-foundry does, but always a divisor)."""
    below = candidates(n, micro // 2)
    return below[0] if below else None


def fingerprint(cfg: RunConfig, env: distributed.Env) -> dict:
    """What the answer depends on: the device and its memory, the model, the shape, dtype and compile."""
    device = "cpu"
    if env.device.type == "cuda":
        props = torch.cuda.get_device_properties(env.device)
        device = f"{props.name} ({props.total_memory} bytes)"
    return {"device": device, "world": env.world, "model": asdict(cfg.model), "seq_len": cfg.train.seq_len,
            "share": share(cfg, env.world), "max": cfg.train.micro_batch_max, "dtype": str(env.dtype),
            "compile": env.compile, "loss": env.loss, "optimizer": cfg.optim.name,
            "parallel": cfg.train.parallel, "activation_checkpointing": cfg.train.activation_checkpointing}


def memory_text(env: distributed.Env) -> str:
    if env.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(env.device)
        return f"{env.device} has {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free now)"
    return "the host's memory"


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def probe_tokens(micro: int, seq_len: int, seed: int) -> torch.Tensor:
    """(micro, seq_len + 1) random token ids the tokenizer can produce: [0, N_VOCAB), never the padded ids
    50257..50303 of the embedding (model.vocab_size). The loss indexes targets into the real vocabulary: a
    padded id as a target is an out-of-bounds index, which on CUDA is a device assert that kills the CUDA
    context (the first GPU run of gpt2-124m died so in the probe; on CPU the plain loss raises IndexError)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, N_VOCAB, (micro, seq_len + 1), generator=gen)


def too_close(peak: int, total: int) -> bool:
    """A size whose step peaks within MARGIN of the card's memory is no fit: fragmentation, an evaluation
    and NCCL's buffers come on top in the real run, and an out-of-memory step under DDP costs a restart."""
    return peak > (1 - MARGIN) * total


def fits(model: torch.nn.Module, optimizer, micro: int, cfg: RunConfig, env: distributed.Env) -> bool:
    """One training step of `model` (what trains: DDP-wrapped under DDP, compiled when the run compiles) on
    `micro` random sequences, with `optimizer`'s state held (held_state). The weights, gradients and random
    streams are as they were afterwards; False when it ran out of memory, or on CUDA came within MARGIN of it."""
    T = cfg.train.seq_len
    params = [p for g in optimizer.param_groups for p in g["params"]]
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state(env.device) if env.device.type == "cuda" else None)
    x = loss = None
    try:
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        x = probe_tokens(micro, T, micro).to(env.device)
        with no_sync(model), env.autocast():
            _, loss = model(x[:, :-1], x[:, 1:], return_logits=False)
        with no_sync(model):
            loss.backward()
        x = loss = None
        for p in params:  # the step's arithmetic on zeros at learning rate 0: no weight moves
            if p.grad is not None:
                p.grad.zero_()
        optimizer.step()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)  # an asynchronous out-of-memory error surfaces here
            total = torch.cuda.get_device_properties(env.device).total_memory
            return not too_close(torch.cuda.max_memory_allocated(env.device), total)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        x = loss = None  # noqa: F841 - dropped before freeing
        for p in params:
            p.grad = None
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], env.device)
        free_memory(env.device)


def no_sync(model: torch.nn.Module):
    """The probe's backward all-reduces no gradients under DDP (no_sync, through torch.compile's wrapper).
    Under FSDP2 it reduce-scatters them as a step's last micro-step does: gradients held back unsharded would
    be added into the first real step's (measured: a 0.01 loss difference); there every rank probes in step,
    its forward all-gathering too (identical cards run out of memory at the same size)."""
    return contextlib.nullcontext() if parallel.is_sharded(model) else parallel.gradient_sync(model, False)


@contextlib.contextmanager
def held_state(optimizer):
    """The optimizer's state allocated as the real run holds it from its first step on (AdamW's moments,
    Muon's momentum): one step on zero gradients at learning rate 0, which moves no weight. Afterwards the
    state is dropped and the rates put back, so the optimizer is as new (a resumed run loads its own state
    after the probe). OutOfMemoryError when the state itself does not fit beside the weights."""
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    rates = [g["lr"] for g in groups]
    try:
        for g in groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p in params:
            p.grad = None
        yield
    finally:
        for g, lr in zip(groups, rates, strict=True):
            g["lr"] = lr
        for p in params:
            p.grad = None
        for o in getattr(optimizer, "optimizers", [optimizer]):
            o.state.clear()


def probe(model: torch.nn.Module, optimizer, cfg: RunConfig, env: distributed.Env,
          beat: Callable[[int], None] | None = None) -> tuple[int | None, list[int]]:
    """(the largest candidate that fits, the ones that did not), each tried as one real step of `model`
    (what trains, before torch.compile: DDP-wrapped under DDP) and `optimizer`. `beat(micro)` before each
    candidate: progress for the hang watchdog (each candidate compiles afresh: minutes on a large model)."""
    # static shapes, as the trainer's step has: one compile per size tried, not a dynamic-shape kernel
    # (a sharded model compiles per block in the trainer; probed eagerly, on the safe side of its memory)
    stepped = torch.compile(model, dynamic=False) if env.compile and not parallel.is_sharded(model) else model
    sizes, failed = candidates(share(cfg, env.world), cfg.train.micro_batch_max), []
    try:
        with held_state(optimizer):
            for micro in sizes:
                if beat is not None:
                    beat(micro)
                if fits(stepped, optimizer, micro, cfg, env):
                    return micro, failed
                failed.append(micro)
            return None, failed
    except torch.OutOfMemoryError:  # the optimizer's state alone does not fit beside the weights
        return None, sizes
    finally:
        if env.compile:  # the probe's graphs must not count against the trainer's recompile limit
            torch.compiler.reset()


def choose(run_dir, model: torch.nn.Module, optimizer, cfg: RunConfig, env: distributed.Env,
           beat: Callable[[int], None] | None = None) -> tuple[int, str, list[int]]:
    """The micro-batch every rank uses (collective), how it was found (for the start line) and the sizes that
    ran out of memory on this rank (the probe's table, gptcore/training/memory.py). Reuses
    <run_dir>/micro_batch.json when this hardware and these settings made it. NothingFits when some rank
    cannot fit a single sequence."""
    fp = fingerprint(cfg, env)
    kept = read_json(run_dir / CHOICE_FILE) or {}
    if all(distributed.all_gather_object(kept.get("fingerprint") == fp)):
        return int(kept["micro_batch"]), f"auto, kept from {CHOICE_FILE}", []
    mine, failed = probe(model, optimizer, cfg, env, beat)
    answers = distributed.all_gather_object((mine, failed[-1] if failed else None, memory_text(env)))
    if any(a is None for a, _, _ in answers):
        r, (_, smallest, memory) = next((r, a) for r, a in enumerate(answers) if a[0] is None)
        raise NothingFits(f"train.micro_batch=auto: not even {smallest} sequence(s) of train.seq_len="
                          f"{cfg.train.seq_len} fit rank {r}: {memory}. Use a GPU with more memory, a shorter "
                          "train.seq_len or a smaller model")
    chosen = min(a for a, _, _ in answers)
    if env.master:
        write_json(run_dir / CHOICE_FILE, {"micro_batch": chosen, "fingerprint": fp,
                                           "out_of_memory_at": sorted({f for _, f, _ in answers if f})})
    tried = ", ".join(str(f) for f in failed)
    return chosen, f"auto: {chosen} fits" + (f", {tried} ran out of memory" if failed else ""), failed


def remember(run_dir, cfg: RunConfig, env: distributed.Env, micro: int) -> None:
    """Keep a micro-batch the trainer fell back to after an out-of-memory step, for the next start."""
    write_json(run_dir / CHOICE_FILE, {"micro_batch": micro, "fingerprint": fingerprint(cfg, env),
                                       "after_out_of_memory": True})


def retry_smaller(error: torch.OutOfMemoryError, auto: bool, run_dir, cfg: RunConfig, env: distributed.Env,
                  optimizer, loader, before: dict, step: int, event: Callable[..., None], record: str = "") -> None:
    """Training step `step` ran out of memory with train.micro_batch=auto (`auto`): drop its partial
    gradients, rewind the data to the step's start (`before`, the loader's state then) and split it into
    smaller micro-batches, so the retry takes the same data and no update is lost or doubled. Under DDP the
    other ranks wait in a collective this rank will not join: the smaller size is kept in micro_batch.json
    and RunError ends the rank, for torchrun to restart the job from its newest checkpoint with it. An
    explicit micro_batch, or nothing smaller: `error` itself."""
    tc = cfg.train
    micro = smaller(tc.micro_batch, share(cfg, env.world))
    if not auto or micro is None:
        raise error
    optimizer.zero_grad(set_to_none=True)
    free_memory(env.device)
    old, tc.micro_batch = tc.micro_batch, micro
    text = (f"out of memory at micro-batch {old} (step {step}): the step is retried with the same "
            f"data at micro-batch {micro}")
    remember(run_dir, cfg, env, micro)  # the next start begins there
    if env.ddp:
        raise RunError(f"{text} after a restart (train.max_restarts): under DDP the other ranks wait in a "
                       f"collective; {CHOICE_FILE} keeps micro-batch {micro} for it") from error
    loader.load_state_dict(before)
    loader.set_micro_batch(micro)
    event(step, text + (f"; memory record in {record}" if record else ""), who="micro-batch",
          **{"train/micro_batch": micro})
