"""Generate text with a registered model: the flow's `sample` stage, and a command.

    sample_task(ckpt, "models:/tiny-cpu/3", "Hello, I'm a language model,", 32)   # kept in <ckpt>/sample.json

    python -m tasks.generate models:/gpt2-124m@best --prompt "Hello, I'm a language model,"
    python -m tasks.generate models:/tiny-cpu/latest --prompt "Once upon" --max-new-tokens 48 --seed 1

Any MLflow model URI works (`models:/<name>@<alias>`, `models:/<name>/<version>`, `models:/<model_id>`,
a local model directory); `@latest` means the newest version. The tracking server is
$MLFLOW_TRACKING_URI, or --tracking-uri, or the embedded store under the pipeline home.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.files import write_json
from integrations import mlflow_store as store
from integrations.mlflow_store import resolve_model_uri

SAMPLE_FILE = "sample.json"


def load(model_uri: str, tracking_uri: str | None = None):
    import mlflow

    store.use_store(tracking_uri)
    return mlflow.pyfunc.load_model(resolve_model_uri(model_uri))


@task(name="sample", cache_policy=NO_CACHE)
def sample_task(ckpt: str, model_uri: str | None, prompt: str, max_new_tokens: int) -> dict:
    """Generate text from the registered model version (or straight from the checkpoint when nothing was
    registered); stored in <checkpoint>/sample.json."""
    params = {"max_new_tokens": max_new_tokens, "seed": 0}  # the rest: the pyfunc's DEFAULT_PARAMS
    if model_uri:
        text = load(model_uri).predict([prompt], params=params)[0]
    else:  # the same generator, straight from the checkpoint
        from gptcore.checkpoint import load_model
        from integrations.mlflow_model import GPTTextGenerator

        gen = GPTTextGenerator()
        gen.model, gen.meta = load_model(Path(ckpt))
        text = gen.predict(None, [prompt], params)[0]
    out = {"model_uri": model_uri, "checkpoint": ckpt, "prompt": prompt, "max_new_tokens": max_new_tokens,
           "text": text}
    write_json(Path(ckpt) / SAMPLE_FILE, out)
    return out


def main(argv: list[str] | None = None) -> int:
    from integrations.mlflow_model import DEFAULT_PARAMS  # imports mlflow: only for the command

    p = argparse.ArgumentParser(description="Generate text with a model from the MLflow registry.")
    p.add_argument("model_uri", help="e.g. models:/gpt2-124m@best")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_PARAMS["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=DEFAULT_PARAMS["temperature"], help="0 = greedy")
    p.add_argument("--top-k", type=int, default=DEFAULT_PARAMS["top_k"], help="0 = no top-k filtering")
    p.add_argument("--seed", type=int, default=DEFAULT_PARAMS["seed"])
    p.add_argument("--tracking-uri", default=None)
    args = p.parse_args(argv)
    from mlflow.exceptions import MlflowException

    try:
        model = load(args.model_uri, args.tracking_uri)
    except (MlflowException, OSError) as e:
        print(f"error: cannot load {args.model_uri}: {e}\nSee registered models and aliases in the "
              "MLflow UI; register one with `python -m tasks.register <checkpoint>`. A model stored through "
              "an MLflow server is read through that server: `make demo` restarts the demo's, or set "
              "MLFLOW_TRACKING_URI (or --tracking-uri) to yours.", file=sys.stderr)
        return 2
    params = {k: getattr(args, k) for k in DEFAULT_PARAMS}  # --max-new-tokens, --temperature, --top-k, --seed
    try:
        texts = model.predict(args.prompt, params=params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text in texts:
        print(text)
        print("---")
    return 0


if __name__ == "__main__":
    sys.exit(main())
