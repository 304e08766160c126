"""The model room: what is trained, and its vocabulary.

    gpt.py          the GPT-2 model (nanoGPT's shape; SDPA flash attention), unwrap / evaluating helpers
    loss.py         the training loss: the fused chunked cross-entropy, or plain logits + cross-entropy
    optim.py        AdamW (and Muon + AdamW) and the learning-rate schedule
    tokenizer.py    GPT-2 BPE through tiktoken (offline ranks shipped in gptcore/assets)
    hf.py           Hugging Face transformers <-> checkpoint conversion

May import: the base modules (config, files). Nothing else of gptcore: data, checkpoints, evaluation and
training all build on the model.
"""
