"""`python -m tasks.generate` and the flow's sample stage run no code from the registry: they fetch only a
version's weights (model.safetensors + meta.json), check them against the version's checkpoint_sha256 tag,
and generate with this repository's code. Against a real `mlflow server` (the session's `mlflow_server`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from gptcore.checkpoints import checkpoint
from gptcore.files import file_sha256
from gptcore.model.tokenizer import decode, encode
from tasks import generate, register
from tests.test_registry import PROMPT, REPO, save_ckpt

PARAMS = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 50, "seed": 5}

# Runs the real command (`python -m tasks.generate ...`) with MLflow's pyfunc loaders replaced by a trap: if
# anything on the path calls them, the process exits 99 at once.
NO_PYFUNC = ("import os, runpy, sys\n"
             "import mlflow.pyfunc, mlflow.pyfunc.model\n"
             "def trap(*a, **k):\n"
             "    print('PYFUNC LOADER CALLED', file=sys.stderr, flush=True)\n"
             "    os._exit(99)\n"
             "mlflow.pyfunc.load_model = mlflow.pyfunc.model._load_pyfunc = trap\n"
             "sys.argv = ['tasks.generate', *sys.argv[1:]]\n"
             "runpy.run_module('tasks.generate', run_name='__main__', alter_sys=True)\n")


def cli(uri: str, model_uri: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", NO_PYFUNC, model_uri, "--prompt", PROMPT, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)


def want_text(ckpt: Path, params: dict = PARAMS) -> str:
    """gptcore's own generation from the checkpoint on disk."""
    model, _ = checkpoint.load_model(ckpt)
    out = model.generate(torch.tensor([encode(PROMPT)]), params["max_new_tokens"],
                         temperature=params["temperature"], top_k=params["top_k"], seed=params["seed"])
    return decode(out[0].tolist())


def stored_weights(srv, mlc: MlflowClient, name: str, version: str) -> Path:
    """model.safetensors of a version, as the server keeps it in its artifact store (the fixture's
    --artifacts-destination): mlflow-artifacts:/<exp>/models/<model_id>/artifacts -> <root>/artifacts/..."""
    location = mlc.get_model_version_download_uri(name, version)
    assert location.startswith("mlflow-artifacts:/"), location
    store = getattr(srv, "artifacts", srv.root / "artifacts")
    path = store / location.removeprefix("mlflow-artifacts:/") / generate.CHECKPOINT_ARTIFACT / generate.WEIGHTS
    assert path.is_file(), path
    return path


@pytest.fixture(scope="module")
def trusted(mlflow_server, tmp_path_factory):
    ck = save_ckpt(tmp_path_factory.mktemp("runs") / "trusted", 6, 8.7, seed=31)
    reg = register.register_checkpoint(ck, model_name="trusted", tracking_uri=mlflow_server.uri, hf=False)
    return ck, reg


def test_a_verified_version_generates_the_checkpoints_tokens_without_the_pyfunc(mlflow_server, trusted,
                                                                                monkeypatch, tmp_path):
    ck, reg = trusted
    uri = mlflow_server.uri
    want = want_text(ck)

    def trap(*a, **k):
        raise AssertionError("mlflow.pyfunc.load_model was called")

    import mlflow.pyfunc
    import mlflow.pyfunc.model
    monkeypatch.setattr(mlflow.pyfunc, "load_model", trap)
    monkeypatch.setattr(mlflow.pyfunc.model, "_load_pyfunc", trap)
    for model_uri in ("models:/trusted@best", "models:/trusted@latest", f"models:/trusted/{reg['version']}",
                      f"models:/{reg['model_id']}", str(ck)):
        m = generate.load(model_uri, uri)
        assert m.predict([PROMPT], params=PARAMS) == [want], model_uri
        assert m.sha256 == reg["tags"]["checkpoint_sha256"] == file_sha256(ck / "model.safetensors")
    assert (m.name, m.version) == (None, None)  # the local checkpoint
    m = generate.load("models:/trusted@best", uri)
    assert (m.name, m.version) == ("trusted", reg["version"])
    ours, _ = checkpoint.load_model(ck)
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), m.model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k

    # the flow's sample stage: the sample task's function, with the loaders still trapped
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_ck = tmp_path / ck.name
    shutil.copytree(ck, run_ck)
    out = generate.sample_task.fn(str(run_ck), reg["model_uri"], PROMPT, 6)
    assert out["text"] == want_text(ck, {**PARAMS, "max_new_tokens": 6, "top_k": 50, "seed": 0})
    assert (run_ck / generate.SAMPLE_FILE).is_file()

    # the command, in a fresh process whose pyfunc loaders exit 99 if called
    p = cli(uri, "models:/trusted@best", "--max-new-tokens", "10", "--seed", "5")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split("\n---\n")[0] == want


def test_tampered_weights_are_refused_by_the_command_and_the_sample_stage(mlflow_server, monkeypatch, tmp_path, capsys):
    uri = mlflow_server.uri
    mlc = MlflowClient(uri, registry_uri=uri)
    ck = save_ckpt(tmp_path / "tampered", 4, 8.9, seed=41)
    reg = register.register_checkpoint(ck, model_name="tampered", tracking_uri=uri, hf=False)
    version, expected = reg["version"], reg["tags"]["checkpoint_sha256"]
    assert generate.load("models:/tampered@best", uri).sha256 == expected  # fine before the attack

    # someone with EDIT on the model replaces the version's weights in the artifact store: other weights
    # of the very same shape, a perfectly loadable file
    other = save_ckpt(tmp_path / "attacker", 4, 1.0, seed=42)
    stored = stored_weights(mlflow_server, mlc, "tampered", version)
    shutil.copyfile(other / "model.safetensors", stored)
    actual = file_sha256(stored)
    assert actual != expected

    p = cli(uri, "models:/tampered@best", "--max-new-tokens", "4")
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    err = p.stderr
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: model 'tampered' version {version} "
                                                     "(models:/tampered@best): its weights"), err
    assert expected in err and actual in err and "python -m tasks.register" in err and "delete" in err, err
    assert str(ck.resolve()) in err, err  # the checkpoint to re-register from
    assert "Traceback" not in err and "PYFUNC LOADER CALLED" not in err and not p.stdout

    # the flow's sample stage fails (the task raises), and writes no sample
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_ck = tmp_path / "run" / ck.name
    shutil.copytree(ck, run_ck)
    with pytest.raises(generate.UntrustedWeights, match=f"model 'tampered' version {version} .*{actual}.*{expected}"):
        generate.sample_task.fn(str(run_ck), f"models:/tampered/{version}", PROMPT, 4)
    assert not (run_ck / generate.SAMPLE_FILE).exists()
    # and `python -m tasks.evaluate models:/...` (same verified fetch) refuses to score it
    from tasks import evaluate as evaluate_cli

    assert evaluate_cli.main(["models:/tampered@best", "--tracking-uri", uri]) == 2
    assert f"error: model 'tampered' version {version} " in capsys.readouterr().err

    # a meta.json that belongs to other weights is refused as well, even when the weights match again
    shutil.copyfile(ck / "model.safetensors", stored)
    shutil.copyfile(other / "meta.json", stored.parent / "meta.json")
    with pytest.raises(generate.UntrustedWeights, match="meta.json records weights"):
        generate.load("models:/tampered@best", uri)
    shutil.copyfile(ck / "meta.json", stored.parent / "meta.json")
    assert generate.load("models:/tampered@best", uri).sha256 == expected

    # a version without the tag cannot be verified: refused, naming the version
    mlc.delete_model_version_tag("tampered", version, "checkpoint_sha256")
    with pytest.raises(generate.UntrustedWeights, match=f"model 'tampered' version {version} .*no checkpoint_sha256"):
        generate.load(f"models:/tampered/{version}", uri)
    assert generate.main(["models:/tampered@best", "--prompt", "x", "--tracking-uri", uri]) == 2


def test_a_meta_json_without_its_hash_or_with_an_absurd_shape_is_refused_before_the_weights(
        mlflow_server, tmp_path, capsys):
    """Someone with EDIT on a model rewrites a version's meta.json: without model_sha256 (so nothing ties it to
    the weights) or with a model shape that would exhaust the worker's memory. Both are refused from meta.json
    alone, naming the fix (re-register), before the weights are downloaded or any tensor is built; a local
    checkpoint with such a shape too."""
    import json

    from gptcore.checkpoints.run_files import CheckpointError
    from integrations.registry_weights import fetch_verified
    from tasks import evaluate as evaluate_cli

    uri = mlflow_server.uri
    mlc = MlflowClient(uri, registry_uri=uri)
    ck = save_ckpt(tmp_path / "unsound", 4, 8.8, seed=43)
    reg = register.register_checkpoint(ck, model_name="unsound", tracking_uri=uri, hf=False)
    stored_meta = stored_weights(mlflow_server, mlc, "unsound", reg["version"]).parent / "meta.json"
    good = json.loads(stored_meta.read_text())
    no_hash = {k: v for k, v in good.items() if k != "model_sha256"}
    huge = {**good, "model_config": {**good["model_config"], "vocab_size": 2 ** 40}}  # 4 TB of embedding
    deep = {**good, "model_config": {**good["model_config"], "n_layer": 100_000}}
    for meta, why in ((no_hash, "records no model_sha256"), (huge, "model.vocab_size=1,099,511,627,776 is over"),
                      (deep, "model.n_layer=100,000 is over")):
        stored_meta.write_text(json.dumps(meta))
        dst = tmp_path / "fetched"
        with pytest.raises(generate.UntrustedWeights, match=f"model 'unsound' version {reg['version']} .*{why}"):
            fetch_verified("models:/unsound@best", dst, uri)
        assert not (dst / "model.safetensors").exists()  # refused from meta.json alone
        with pytest.raises(generate.UntrustedWeights, match="re-register the checkpoint"):
            generate.load("models:/unsound@best", uri)
        assert generate.main(["models:/unsound@best", "--prompt", "x", "--tracking-uri", uri]) == 2
        assert evaluate_cli.main(["models:/unsound@best", "--no-hellaswag", "--tracking-uri", uri]) == 2
        assert why in capsys.readouterr().err
    stored_meta.write_text(json.dumps(good))
    assert generate.load("models:/unsound@best", uri).sha256 == reg["tags"]["checkpoint_sha256"]

    local = tmp_path / "local"  # a checkpoint directory whose meta.json keeps its hash but not a sane shape
    shutil.copytree(ck, local)
    (local / "meta.json").write_text(json.dumps(huge))
    with pytest.raises(CheckpointError, match="no usable model_config .*vocab_size"):
        generate.load(str(local))


def test_unsupported_uris_are_one_error_line(tmp_path, capsys):
    assert generate.main([str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a registered model nor a checkpoint directory" in capsys.readouterr().err
    assert generate.main(["runs:/abc/model", "--prompt", "x"]) == 2
    assert "models:/<name>@<alias>" in capsys.readouterr().err


def test_the_sample_stage_says_what_it_generated_and_where():
    """The flow's stages table and log line: a sample that ran names its length, source and file, like the
    other stages' lines; a stored one says where it was found."""
    from types import SimpleNamespace

    run = SimpleNamespace(ckpt="/h/runs/tiny-cpu/checkpoints/step_00000120")
    sample = {"model_uri": "models:/tiny-cpu/1", "max_new_tokens": 32, "text": "Hello"}
    assert generate.STAGE.reason(run, sample, ran=True) == \
        f"32 tokens from models:/tiny-cpu/1 into {run.ckpt}/{generate.SAMPLE_FILE}"
    from_checkpoint = generate.STAGE.reason(run, {**sample, "model_uri": None}, ran=True)
    assert from_checkpoint.startswith("32 tokens from the checkpoint into ")
    assert generate.STAGE.reason(run, sample, ran=False) == \
        f"{run.ckpt}/{generate.SAMPLE_FILE} holds text from models:/tiny-cpu/1"
