"""Checkpoints, one package: what a run directory holds and how a checkpoint is written, read and resumed.

    checkpoint.py   the format and the one writer and reader: model.safetensors + trainer.pt + meta.json,
                    hashed while written, swapped in atomically, retention; load and verify
    background.py   the async writer (Checkpointer): the ranks wait for a copy of the state, not the disk
    sharded.py      FSDP2's sharded steps: every rank writes its shard with DCP, read back on any world size
    run_files.py    the run directory's names and files read without torch (run.json, DONE, eval.json,
                    the checkpoint list): what the flow's skip decisions read

Where an invocation starts from its checkpoints (the pre-flight, restore, roll back) is the training room's
(gptcore/training/resume.py). May import: the base modules (config, files, distributed, metrics, runlock)
and gptcore.model. Nothing is imported here: `from gptcore.checkpoints import run_files` must not import
torch.
"""
