"""A stand-in for build-nanogpt's train_gpt2.py, of the same form, written here: a script whose module-level
settings (total_batch_size, B, T, use_compile, max_steps, enc) the reference harness replaces, that reads
`edu_fineweb10B/*{train,val}*.npy` from its working directory, trains the plain GPT of
benchmarks/bench_train.py (BaseGPT: no guards) with fused AdamW, bf16 autocast on CUDA and gradient
accumulation, and prints one `step N | loss: L | ... | dt: D ms | tok/sec: R` line per step.

It also does what the real file does around its steps that can break the harness (issue 51): it imports
`hellaswag` (the harness answers it), evaluates the validation loss on its first and last step, appends to
log/log.txt, and on its last step saves a checkpoint holding a dataclass defined in this file (pickle must
find `__main__.RunConfig`, as it must find the real file's `__main__.GPTConfig`).

gpu_check's reference row runs it on CPU and in CI, so the row's machinery (launch, data, parsing, ratios)
is tested without the real file, whose code stays out of this repository (benchmarks/reference_run.py).
Single process only (the real file's DDP path needs CUDA and NCCL).
"""

import os
import time
from dataclasses import dataclass

import numpy as np
import tiktoken
import torch
from hellaswag import iterate_examples, render_example  # noqa: F401 - imported, as the real file does

from benchmarks.bench_train import BaseGPT
from gptcore.config import ModelConfig

total_batch_size = 4096
B = 4
T = 64
use_compile = False
max_steps = 8
n_layer = 2  # the stand-in's own model knobs (the real file's model is GPT-2 124M)
n_head = 2
n_embd = 64
enc = tiktoken.get_encoding("gpt2")  # as the real file does at import; the harness supplies it offline

device = "cuda" if torch.cuda.is_available() else "cpu"
assert total_batch_size % (B * T) == 0, "total_batch_size must be a multiple of B * T"
grad_accum_steps = total_batch_size // (B * T)


class ShardStream:
    """Consecutive (B, T) batches through the split's .npy shards, in name order, wrapping around."""

    def __init__(self, split: str):
        folder = "edu_fineweb10B"
        self.paths = sorted(os.path.join(folder, n) for n in os.listdir(folder) if split in n)
        assert self.paths, f"no {split} shards in {folder}"
        self.shard, self.pos = 0, 0
        self.tokens = self.load()

    def load(self) -> torch.Tensor:
        return torch.from_numpy(np.load(self.paths[self.shard]).astype(np.int64))

    def next_batch(self):
        buf = self.tokens[self.pos:self.pos + B * T + 1]
        self.pos += B * T
        if self.pos + B * T + 1 > len(self.tokens):
            self.shard, self.pos = (self.shard + 1) % len(self.paths), 0
            self.tokens = self.load()
        return buf[:-1].view(B, T).to(device), buf[1:].view(B, T).to(device)




@dataclass
class RunConfig:  # defined in this file, pickled in the last step's checkpoint as the real file's GPTConfig
    n_layer: int
    n_head: int
    n_embd: int


def val_loss() -> float:
    val, total = ShardStream("val"), 0.0
    with torch.no_grad():
        for _ in range(2):
            x, y = val.next_batch()
            with torch.autocast(device_type=device, dtype=autocast_dtype, enabled=device == "cuda"):
                total += model(x, y).item() / 2
    return total


torch.manual_seed(1337)
model = BaseGPT(ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=T)).to(device)
raw_model = model
if use_compile:
    model = torch.compile(model)
decay = [p for p in raw_model.parameters() if p.dim() >= 2]
other = [p for p in raw_model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                              lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
train = ShardStream("train")
autocast_dtype = torch.bfloat16 if device == "cuda" else torch.float32
os.makedirs("log", exist_ok=True)
log_file = os.path.join("log", "log.txt")
with open(log_file, "w"):
    pass
for step in range(max_steps):
    t0 = time.time()
    last_step = step == max_steps - 1
    if step == 0 or last_step:
        loss = val_loss()
        print(f"validation loss: {loss:.4f}")
        with open(log_file, "a") as f:
            f.write(f"{step} val {loss:.4f}\n")
        if last_step:
            checkpoint = {"model": raw_model.state_dict(), "config": RunConfig(n_layer, n_head, n_embd), "step": step}
            torch.save(checkpoint, os.path.join("log", f"model_{step:05d}.pt"))
    optimizer.zero_grad(set_to_none=True)
    loss_accum = 0.0
    for _ in range(grad_accum_steps):
        x, y = train.next_batch()
        with torch.autocast(device_type=device, dtype=autocast_dtype, enabled=device == "cuda"):
            loss = model(x, y) / grad_accum_steps
        loss_accum += loss.detach()
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.time() - t0
    print(f"step {step:5d} | loss: {loss_accum.item():.6f} | norm: {norm:.4f} | dt: {dt * 1000:.2f}ms | "
          f"tok/sec: {total_batch_size / dt:.2f}", flush=True)
    with open(log_file, "a") as f:
        f.write(f"{step} train {loss_accum.item():.6f}\n")
