"""Generate text with a registered model: the flow's `sample` stage, and a command.

    sample_task(ckpt, "models:/tiny-cpu/3", "Hello, I'm a language model,", 32)   # kept in <ckpt>/sample.json

    python -m tasks.generate models:/gpt2-124m@best --prompt "Hello, I'm a language model,"
    python -m tasks.generate models:/tiny-cpu/latest --prompt "Once upon" --max-new-tokens 48 --seed 1

Model URIs: `models:/<name>@<alias>`, `models:/<name>/<version>`, `models:/<model_id>` (a logged model),
or a local checkpoint directory; `@latest` (and `/latest`) means the newest version. The tracking server is
$MLFLOW_TRACKING_URI, or --tracking-uri, or the embedded store under the pipeline home.

Nothing the registry holds runs as code here. A registered version is a pyfunc (integrations/mlflow_model.py,
stored *as code* with the model), and `mlflow.pyfunc.load_model` would execute that stored code: whoever can
edit the model's artifacts could run anything on the worker. So this module never loads the pyfunc. It
downloads only the version's weights and their config (`artifacts/checkpoint/model.safetensors` +
`meta.json` of the logged model, the layout tasks/register.py logs), checks the weights' sha256 against the
version's `checkpoint_sha256` tag (set when the version was created) before reading them, builds the GPT
with gptcore and generates with this repository's own code. A mismatch, or a version without the tag, is an
UntrustedWeights error naming the model, the version, both hashes and the fix (integrations/registry_weights.py,
shared with `python -m tasks.evaluate models:/...`). Serving the pyfunc with
`mlflow models serve` is the user's explicit choice and keeps working as documented.
"""

from __future__ import annotations

# lazy imports: torch and mlflow only where there is work; the flow imports this module to decide what to skip
import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.files import read_json, write_json
from integrations.progress import artifact_key
from integrations.registry_weights import (
    CHECKPOINT_ARTIFACT,
    META,
    URI_FORMS,
    WEIGHTS,
    UntrustedWeights,
    fetch_verified,
)
from tasks.stage import FlowRun, Stage

SAMPLE_FILE = "sample.json"



@dataclass
class VerifiedModel:
    """A GPT built from verified weights, and where they came from. predict() is the pyfunc's interface
    (integrations/mlflow_model.py: prompts -> prompt + continuation, same params, same outputs), run by
    this repository's code on the worker."""

    model: object  # gptcore.model.gpt.GPT, in eval mode on the CPU
    meta: dict
    model_uri: str
    sha256: str
    name: str | None = None
    version: str | None = None
    _gen: object = field(default=None, repr=False)

    def predict(self, prompts, params: dict | None = None) -> list[str]:
        if self._gen is None:
            from integrations.mlflow_model import GPTTextGenerator  # this checkout's class, not the registry's

            self._gen = GPTTextGenerator()
            self._gen.model, self._gen.meta = self.model, self.meta
        return self._gen.predict(None, prompts, params)


def _local_checkpoint(model_uri: str) -> Path | None:
    """A local checkpoint directory (or an unpacked pyfunc model directory holding one), else None."""
    p = Path(model_uri)
    for d in (p, p / CHECKPOINT_ARTIFACT):
        if (d / META).is_file() and (d / WEIGHTS).is_file():
            return d
    return None


def load(model_uri: str, tracking_uri: str | None = None) -> VerifiedModel:
    """The model `model_uri` names, built from its verified weights (see the module docstring); never runs
    code stored in the registry."""
    from gptcore.checkpoints import checkpoint
    from gptcore.checkpoints.run_files import read_meta
    from integrations.mlflow_store import resolve_model_uri

    model_uri = resolve_model_uri(model_uri)
    if not model_uri.startswith("models:/"):
        local = _local_checkpoint(model_uri)
        if local is None:
            raise UntrustedWeights(f"{model_uri} is neither a registered model nor a checkpoint directory "
                                   f"(meta.json + model.safetensors); give {URI_FORMS}")
        expected = read_meta(local).get("model_sha256")
        if not expected:
            raise UntrustedWeights(f"{local}/{META} records no model_sha256, so {WEIGHTS} cannot be verified")
        model, meta = checkpoint.load_model(local, device="cpu", verify=True)  # checks it against meta.json
        return VerifiedModel(model, meta, model_uri, expected)
    with tempfile.TemporaryDirectory(prefix="gptpipe-generate-") as tmp:
        ckpt, src = fetch_verified(model_uri, Path(tmp), tracking_uri)  # weights and meta.json checked
        # the temp dir is private (0700), so the file read is the file checked
        model, meta = checkpoint.load_model(ckpt, device="cpu", verify=False)
    return VerifiedModel(model, meta, model_uri, src.expected, src.name, src.version)


def stored_sample(ckpt: str | Path, model_uri: str | None, prompt: str, max_new_tokens: int) -> dict | None:
    """<checkpoint>/sample.json when it holds text from this model version, prompt and length, else None:
    what the sample stage finds (it is skipped then), and what sample_task asks too."""
    sample = read_json(Path(ckpt) / SAMPLE_FILE, {})  # {} when missing, unreadable or not an object
    same = [sample.get(k) for k in ("model_uri", "prompt", "max_new_tokens")] == [model_uri, prompt, max_new_tokens]
    return sample if same and isinstance(sample.get("text"), str) else None


@task(name="sample", cache_policy=NO_CACHE)
def sample_task(ckpt: str, model_uri: str | None, prompt: str, max_new_tokens: int) -> dict:
    """Generate text from the registered model version (or straight from the checkpoint when nothing was
    registered); stored in <checkpoint>/sample.json. The version's weights are checked against its
    checkpoint_sha256 tag and run by this repository's code (load); UntrustedWeights fails the task."""
    if (stored := stored_sample(ckpt, model_uri, prompt, max_new_tokens)) is not None:
        return stored
    params = {"max_new_tokens": max_new_tokens, "seed": 0}  # the rest: the pyfunc's DEFAULT_PARAMS
    if model_uri:
        text = load(model_uri).predict([prompt], params=params)[0]
    else:  # the same generator, straight from the checkpoint
        from gptcore.checkpoints.checkpoint import load_model
        from integrations.mlflow_model import GPTTextGenerator

        gen = GPTTextGenerator()
        gen.model, gen.meta = load_model(Path(ckpt))
        text = gen.predict(None, [prompt], params)[0]
    out = {"model_uri": model_uri, "checkpoint": ckpt, "prompt": prompt, "max_new_tokens": max_new_tokens,
           "text": text}
    write_json(Path(ckpt) / SAMPLE_FILE, out)
    return out


class SampleStage(Stage):
    """A text sample from what was registered (or from the checkpoint when nothing was); stored when
    <checkpoint>/sample.json holds text from that version, prompt and length; the sample artifact."""
    name = "sample"

    @staticmethod
    def asked(run: FlowRun) -> tuple:
        model_uri = run.reg["model_uri"] if run.reg else None
        return run.ckpt, model_uri, run.cfg.eval.sample_prompt, run.cfg.eval.sample_tokens

    def stored(self, run: FlowRun) -> dict | None:
        return stored_sample(*self.asked(run))

    def work(self, run: FlowRun) -> dict:
        return sample_task(*self.asked(run))

    def reason(self, run: FlowRun, sample: dict, ran: bool) -> str:
        source = sample["model_uri"] or "the checkpoint"
        if ran:  # what it generated, from what, and where the text is (the stages table shows this line)
            return f"{sample['max_new_tokens']} tokens from {source} into {run.ckpt}/{SAMPLE_FILE}"
        return f"{run.ckpt}/{SAMPLE_FILE} holds text from {source}"

    def keep(self, run: FlowRun, sample: dict) -> None:
        from prefect.artifacts import create_markdown_artifact

        source = sample.get("model_uri") or run.ckpt
        create_markdown_artifact(f"### Sample from {source}\n\n```\n{sample['text']}\n```",
                                 key=artifact_key(run.cfg.run_name, "sample"), description="Generated text")
        run.sample = sample


STAGE = SampleStage()


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

    from gptcore.checkpoints.run_files import CheckpointError
    from gptcore.config import ConfigError

    try:
        model = load(args.model_uri, args.tracking_uri)
    except (UntrustedWeights, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (MlflowException, OSError) as e:
        print(f"error: cannot load {args.model_uri}: {e}\nSee registered models and aliases in the "
              "MLflow UI; register one with `python -m tasks.register <checkpoint>`. A model stored through "
              "an MLflow server is read through that server: `make demo` restarts the demo's, or set "
              "MLFLOW_TRACKING_URI (or --tracking-uri) to yours.", file=sys.stderr)
        return 2
    params = {k: getattr(args, k) for k in DEFAULT_PARAMS}  # --max-new-tokens, --temperature, --top-k, --seed
    try:
        texts = model.predict(args.prompt, params=params)
    except (ValueError, MlflowException) as e:  # the generator's bad-request errors name the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text in texts:
        print(text)
        print("---")
    return 0


if __name__ == "__main__":
    sys.exit(main())
