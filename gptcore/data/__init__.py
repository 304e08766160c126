"""The data room: from a source's files to the shards the trainer reads, one module per step.

    sources.py        where text comes from: SOURCE_KINDS, one module each (source_builtin, source_hub: the
                      Hugging Face hub through `datasets`' resolution, source_local: a path or glob; the
                      interface in source_kind.py), fetched and verified into <home>/raw/<source_id>/
    formats.py        how documents are read from a file: FORMATS (parquet, JSON Lines / arrays, txt; json,
                      jsonl and txt also gzip/bz2/xz-compressed)
    location.py       where a dataset lives and whether it is complete (what the trainer, the evaluator and
                      the flow's skip check import; not the builder)
    planning.py       the source cut into pieces: fixed document ranges, independent of the worker count
    tokenizing.py     one piece tokenized (GPT-2 BPE, EOT before each document) into its token file
    cutting.py        shards cut from the pieces in order, kept when unchanged; the manifest written last
    build.py          the driver: lock, fetch -> plan -> tokenize in parallel -> cut, the process pool and
                      `python -m gptcore.data.build <preset>`
    shard_format.py   the shard file format (llm.c's) and the manifest, the one reader and writer
    loader.py         what the trainer reads: hash-verified shards, the global shuffled batch stream

Nothing here imports torch except loader.py, so the flow's skip checks stay cheap. May import: the base
modules and model (the tokenizer).
"""
