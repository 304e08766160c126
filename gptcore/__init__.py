"""gptcore: pure PyTorch/numpy GPT-2 pretraining, runnable under plain torchrun (never imports Prefect or
MLflow). Rooms by concept, each a package whose docstring says what lives there and what it may import;
imports point down this list only (tests/test_layout.py checks it):

    base modules    config (typed dataclasses, presets), files (atomic writes, hashes), distributed
                    (process group, ranks), metrics (the JSONL log), launch (the torchrun command), runlock
    model/          the GPT, its loss and optimizers, the tokenizer, Hugging Face conversion
    data/           source files -> token shards + manifest; the shard loader
    checkpoints/    the checkpoint format, its async writer, the run directory read without torch
    evals/          the evaluations (registry + one module each), their scorers, the standalone evaluate
    training/       the entry point (python -m gptcore.training.train), the loop and each defence
"""
