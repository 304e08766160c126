"""The registered model as users serve it: `mlflow models serve -m models:/<name>@best` (the real scoring
server, on 127.0.0.1, resolving the alias through the test MLflow server) answers each documented payload
form with generated text, and a bad payload with a 4xx that names the problem."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import mlflow.artifacts
import pytest
from mlflow import MlflowClient

from tasks import register
from tests.mlflow_server import free_port
from tests.test_registry import PROMPT, save_ckpt


def post(url: str, payload) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture
def served(mlflow_server, tmp_path):
    ck = save_ckpt(tmp_path / "served", 8, 8.5, seed=21)
    reg = register.register_checkpoint(ck, model_name="served", tracking_uri=mlflow_server.uri, hf=False)
    port = free_port()
    # the scoring server execs `uvicorn` from PATH: this environment's, as an activated venv has it
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server.uri, OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/served@best",
                             "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"],
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"the scoring server did not answer /ping in 180 s:\n{log.read_text()[-3000:]}")
        yield base, reg, mlflow_server.uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_best_model_serves_text_and_refuses_bad_payloads(served, monkeypatch):
    base, reg, uri = served
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # resolves the logged model's mlflow-artifacts: location
    url = f"{base}/invocations"
    # the logged model carries its input example and the serving payload made from it
    mlc = MlflowClient(uri)
    files = {f.path for f in mlc.list_logged_model_artifacts(reg["model_id"])}
    assert {"input_example.json", "serving_input_example.json"} <= files, files
    location = mlc.get_logged_model(reg["model_id"]).artifact_location
    example = json.loads(mlflow.artifacts.load_text(f"{location}/serving_input_example.json"))
    forms = [
        example,  # what the README's curl sends
        {"inputs": [PROMPT, "The meaning of life is"], "params": {"max_new_tokens": 5}},
        {"dataframe_records": [{"prompt": PROMPT}], "params": {"max_new_tokens": 4, "temperature": 0.0}},
        {"dataframe_split": {"columns": ["prompt"], "data": [[PROMPT]]}, "params": {"max_new_tokens": 4}},
    ]
    for payload in forms:
        status, body = post(url, payload)
        assert status == 200, (payload, body)
        texts = body["predictions"]
        prompts = payload.get("inputs") or [PROMPT]
        assert len(texts) == len(prompts) and all(isinstance(t, str) for t in texts), body
        assert all(t.startswith(p) and len(t) > len(p) for t, p in zip(texts, prompts, strict=True)), body
    status, body = post(url, forms[2])
    assert (status, post(url, forms[2])[1]) == (200, body)  # greedy: the same text every time

    # each refusal carries integrations/mlflow_model.py's own message (not just any 4xx)
    bad = {
        "wrong column": ({"dataframe_records": [{"text": PROMPT}]}, "the input has columns ['text'], not 'prompt'"),
        "non-string prompt": ({"inputs": [123]}, "prompts must be strings, got int 123; quote it"),
        "negative max_new_tokens": ({"inputs": [PROMPT], "params": {"max_new_tokens": -3}},
                                    "params.max_new_tokens=-3; use a positive number of tokens"),
    }
    for what, (payload, names) in bad.items():
        status, body = post(url, payload)
        assert 400 <= status < 500, (what, status, body)
        assert names in body.get("message", ""), (what, body)
