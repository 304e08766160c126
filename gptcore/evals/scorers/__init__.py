"""How each evaluation scores a model (the evaluations in gptcore/evals/ call these):

    hellaswag.py        HellaSwag from completion loss (build-nanogpt's acc_norm), its dataset download
    harness.py          lm-evaluation-harness tasks on our GPT (its TemplateLM interface)
    harness_scoring.py  batched continuation log-likelihoods for the harness
    contamination.py    n-gram overlap between evaluation examples and the training shards

May import: the base modules, model, data.
"""
