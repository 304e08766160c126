"""The registered model's inference form: an MLflow pyfunc model that generates text.

Logged "from code" (MLflow 3's recommended way: this file is stored with the model and executed at
load time, nothing is pickled), with the `gptcore` package as code_paths and one artifact:
`checkpoint`, a directory holding the checkpoint's model.safetensors + meta.json, loaded with the one
checkpoint reader (gptcore.checkpoints.checkpoint.load_model). So the model loads wherever torch, tiktoken,
safetensors and mlflow are installed, without this repository.

    m = mlflow.pyfunc.load_model("models:/gpt2-124m@best")
    m.predict(["Hello, I'm a language model,"], params={"max_new_tokens": 32, "seed": 0})
    -> ["Hello, I'm a language model, ..."]            (prompt + continuation, one per prompt)

Inputs: a list of strings, a string, or a DataFrame with a `prompt` column. Params: max_new_tokens
(>= 1), temperature (>= 0; 0 = greedy), top_k (>= 0; 0 = off), seed; sampling uses its own seeded
generator, so equal inputs give equal outputs. Anything else is refused with an MlflowException naming
the fix, which `mlflow models serve` answers with HTTP 400. Served, the same three forms are:

    {"inputs": ["Hello, I'm a language model,"], "params": {"max_new_tokens": 16}}
    {"dataframe_records": [{"prompt": "Hello, I'm a language model,"}]}
    {"dataframe_split": {"columns": ["prompt"], "data": [["Hello, I'm a language model,"]]}}
-> {"predictions": ["Hello, I'm a language model, ..."]}
"""

from __future__ import annotations

# lazy imports: `mlflow models serve` imports this module to find the pyfunc; torch loads with the model
import mlflow
from mlflow.exceptions import MlflowException
from mlflow.models import set_model
from mlflow.models.signature import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
from mlflow.types.schema import AnyType

DEFAULT_PARAMS = {"max_new_tokens": 32, "temperature": 1.0, "top_k": 50, "seed": 0}
INPUT_EXAMPLE = (["Hello, I'm a language model,"], {"max_new_tokens": 16})  # logged with the model

# The input column is declared Any, not string: MLflow's schema enforcement would turn {"inputs": [123]}
# into the prompt "123" (so a client's bug would get made-up text back); _prompts refuses non-strings.
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec(AnyType())]),
    outputs=Schema([ColSpec("string")]),
    params=ParamSchema([ParamSpec(name, "double" if isinstance(default, float) else "long", default)
                        for name, default in DEFAULT_PARAMS.items()]),
)


def _bad_request(message: str) -> MlflowException:
    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)  # HTTP 400 from the scoring server


def _prompts(model_input) -> list[str]:
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # pandas DataFrame: its `prompt` column, or the one column of a list
        columns = [str(c) for c in model_input.columns]
        if "prompt" in columns:
            model_input = model_input["prompt"]
        elif len(columns) == 1 and columns[0] == "0":
            model_input = model_input.iloc[:, 0]
        else:
            raise _bad_request(f"the input has columns {columns}, not 'prompt'; send "
                               '{"dataframe_records": [{"prompt": "..."}]} or {"inputs": ["..."]}')
        model_input = model_input.tolist()
    prompts = list(model_input)
    wrong = [p for p in prompts if not isinstance(p, str)]
    if wrong:
        raise _bad_request(f"prompts must be strings, got {type(wrong[0]).__name__} {wrong[0]!r}; quote it")
    return prompts


def _params(params: dict | None) -> dict:
    p = {**DEFAULT_PARAMS, **(params or {})}
    if int(p["max_new_tokens"]) < 1:
        raise _bad_request(f"params.max_new_tokens={p['max_new_tokens']}; use a positive number of tokens")
    if float(p["temperature"]) < 0 or int(p["top_k"]) < 0:
        raise _bad_request(f"params.temperature={p['temperature']}, params.top_k={p['top_k']}; both must be "
                           ">= 0 (temperature 0 = greedy, top_k 0 = off)")
    return p


class GPTTextGenerator(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from gptcore.checkpoints.checkpoint import load_model

        self.model, self.meta = load_model(context.artifacts["checkpoint"], device="cpu")  # in eval mode

    def generate(self, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> str:
        import torch

        from gptcore.model.tokenizer import decode, encode

        ids = encode(prompt)
        if not ids:
            raise _bad_request("empty prompt: give at least one character of text to continue")
        if max_new_tokens >= self.model.config.block_size:
            raise _bad_request(f"params.max_new_tokens={max_new_tokens}; this model's context is "
                               f"{self.model.config.block_size} tokens: ask for fewer")
        # A prompt longer than the context keeps its tail (the part the model can see).
        keep = max(1, self.model.config.block_size - max_new_tokens)
        head, ids = ids[:-keep], ids[-keep:]
        out = self.model.generate(torch.tensor([ids]), max_new_tokens, temperature=temperature,
                                  top_k=top_k or None, seed=seed)
        return decode(head + out[0].tolist())

    # No type hints on purpose: MLflow would infer a signature from them that replaces SIGNATURE and
    # drops its params schema (so it warns once at import; harmless).
    def predict(self, context, model_input, params=None):
        p = _params(params)
        return [self.generate(prompt, int(p["max_new_tokens"]), float(p["temperature"]), int(p["top_k"]),
                              int(p["seed"])) for prompt in _prompts(model_input)]


set_model(GPTTextGenerator())
