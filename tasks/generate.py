"""Generate text with a registered model:

    python -m tasks.generate models:/gpt2-124m@best --prompt "Hello, I'm a language model,"
    python -m tasks.generate models:/tiny-cpu/latest --prompt "Once upon" --max-new-tokens 48 --seed 1

Any MLflow model URI works (`models:/<name>@<alias>`, `models:/<name>/<version>`, `models:/<model_id>`,
a local model directory); `@latest` means the newest version. The tracking server is
$MLFLOW_TRACKING_URI, or --tracking-uri, or the embedded store under the pipeline home.
"""

from __future__ import annotations

import argparse
import sys

from tasks import mlflow_store as store
from tasks.mlflow_model import DEFAULT_PARAMS
from tasks.mlflow_store import resolve_model_uri


def load(model_uri: str, tracking_uri: str | None = None):
    import mlflow

    store.use_store(tracking_uri)
    return mlflow.pyfunc.load_model(resolve_model_uri(model_uri))


def main(argv: list[str] | None = None) -> int:
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
              "MLflow UI; register one with `python -m tasks.register <checkpoint>`.",
              file=sys.stderr)
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
