"""The data room: from a source's files to the shards the trainer reads, one module per step.

    sources.py        where text comes from: SOURCE_KINDS (builtin, the Hugging Face hub through `datasets`'
                      resolution, a local path or glob), fetched and verified into <home>/raw/<source_id>/
    formats.py        how documents are read from a file: FORMATS (parquet, JSON Lines / arrays, txt; json,
                      jsonl and txt also gzip/bz2/xz-compressed)
    build.py          tokenize-and-shard: plan pieces, tokenize them in parallel (GPT-2 BPE), cut shards in
                      order, write the manifest; `python -m gptcore.data.build <preset>`
    shard_format.py   the shard file format (llm.c's) and the manifest, the one reader and writer
    loader.py         what the trainer reads: hash-verified shards, the global shuffled batch stream

Nothing here imports torch except loader.py, so the flow's skip checks stay cheap.
"""
