"""The registered model's inference form: an MLflow pyfunc model that generates text.

Logged "from code" (MLflow 3's recommended way: this file is stored with the model and executed at
load time, nothing is pickled), with the `gptcore` package as code_paths and one artifact:
`checkpoint`, a directory holding the checkpoint's model.safetensors + meta.json, loaded with the one
checkpoint reader (gptcore.checkpoint.load_model). So the model loads wherever torch, tiktoken,
safetensors and mlflow are installed, without this repository.

    m = mlflow.pyfunc.load_model("models:/gpt2-124m@best")
    m.predict(["Hello, I'm a language model,"], params={"max_new_tokens": 32, "seed": 0})
    -> ["Hello, I'm a language model, ..."]            (prompt + continuation, one per prompt)

Inputs: a list of strings, a string, or a DataFrame with a `prompt` column. Params: max_new_tokens,
temperature (0 = greedy), top_k (0 = off), seed; sampling uses its own seeded generator, so equal
inputs give equal outputs.
"""

from __future__ import annotations

import mlflow
from mlflow.models import set_model
from mlflow.models.signature import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

DEFAULT_PARAMS = {"max_new_tokens": 32, "temperature": 1.0, "top_k": 50, "seed": 0}

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string")]),
    outputs=Schema([ColSpec("string")]),
    params=ParamSchema([ParamSpec(name, "double" if isinstance(default, float) else "long", default)
                        for name, default in DEFAULT_PARAMS.items()]),
)


def _prompts(model_input) -> list[str]:
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # pandas DataFrame: its `prompt` column, else the first
        model_input = model_input["prompt" if "prompt" in model_input.columns else model_input.columns[0]].tolist()
    return [str(p) for p in model_input]


class GPTTextGenerator(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from gptcore.checkpoint import load_model

        self.model, self.meta = load_model(context.artifacts["checkpoint"], device="cpu")  # in eval mode

    def generate(self, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> str:
        import torch

        from gptcore.tokenizer import decode, encode

        ids = encode(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one character of text to continue")
        # A prompt longer than the context keeps its tail (the part the model can see).
        keep = max(1, self.model.config.block_size - max_new_tokens)
        head, ids = ids[:-keep], ids[-keep:]
        out = self.model.generate(torch.tensor([ids]), max_new_tokens, temperature=temperature,
                                  top_k=top_k or None, seed=seed)
        return decode(head + out[0].tolist())

    # No type hints on purpose: MLflow would infer a signature from them that replaces SIGNATURE and
    # drops its params schema (so it warns once at import; harmless).
    def predict(self, context, model_input, params=None):
        p = {**DEFAULT_PARAMS, **(params or {})}
        return [self.generate(prompt, int(p["max_new_tokens"]), float(p["temperature"]), int(p["top_k"]),
                              int(p["seed"])) for prompt in _prompts(model_input)]


set_model(GPTTextGenerator())
