"""The training room: `python -m gptcore.training.train` under torchrun, and what keeps a long run alive.

    train.py        the entry point: config, pre-flight, process group, the Trainer, exit codes
    resume.py       where an invocation starts: every input check, the newest checkpoint that verifies
                    whole (a bad one moved to checkpoints/rejected/), a damaged shard rebuilt, restore
    trainer.py      the loop: steps, logging, checkpoints, evaluations, stop requests
    train_eval.py   the trainer's evaluation hook (each evaluation at its own interval)
    guard.py        loss spikes and NaNs: roll back; test-only fault injection
    watchdog.py     a rank that stops progressing: stacks, exit 5; a C backstop when Python cannot run
    replicas.py     weight checksums across ranks (a second disagreement: exit 4), per-rank compute times
                    (stragglers)
    microbatch.py   train.micro_batch=auto: the largest micro-batch the device fits; a step out of memory
                    retried smaller
    damage.py       shards that rot mid-run: an event, and dropped from the hash caches for a rebuild
    verdict.py      an exit a restart cannot change, kept on disk for the launcher
    orphan.py       a rank whose torchrun agent died: exit 6 within seconds, no checkpoint

May import every other room (it is the top): base modules, model, data, checkpoints, evals.
"""
