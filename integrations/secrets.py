"""Credentials for flow runs that a work pool starts (docker containers, Kubernetes Jobs), kept out of job
variables: Prefect stores a deployment's or pool's job variables in plain text, readable by every API user.

- Prefect: the flow run needs PREFECT_API_AUTH_STRING before any code of ours runs (to report its state),
  so it cannot come from Prefect itself. A worker hands its own Prefect settings to the runs it starts
  (Prefect's `BaseJobConfiguration._base_environment`): start the docker worker with
  PREFECT_API_AUTH_STRING in its environment and the flow-run containers get it, without it being stored
  anywhere in Prefect. Kubernetes Jobs read it from the Secret `gpt2-auth` (deployments/k8s-*).
- MLflow: the flow run reads MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD from the Prefect Secret
  blocks `mlflow-worker-username` / `mlflow-worker-password` at its start when its environment lacks them
  (`mlflow_credentials_from_prefect`), and puts them in its environment for the MLflow clients, the
  trainer's metric shipper and every process it starts. The Prefect server keeps Secret blocks encrypted
  with PREFECT_SERVER_ENCRYPTION_KEY (compose: from docker/.env, never in its database), and the API
  returns their values to any client with the Prefect credential that asks for them.

Save the blocks once, from a shell that has the worker's MLflow credentials in its environment (the
compose worker does: docs/docker.md "Docker work pool"):

    PREFECT_API_AUTH_STRING=... MLFLOW_TRACKING_USERNAME=worker MLFLOW_TRACKING_PASSWORD=... \\
        python -m integrations.secrets save-mlflow

The values are read from the environment, never from the command line (which `ps` shows).
"""

from __future__ import annotations

# lazy imports: prefect's settings and blocks only inside a flow run that reads them
import logging
import os
import sys

USERNAME_BLOCK = "mlflow-worker-username"
PASSWORD_BLOCK = "mlflow-worker-password"
DEFAULT_USERNAME = "worker"  # the compose stack's and devstack's worker account


def _prefect_api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or ""


def _load_secret(name: str) -> str | None:
    """The value of the Secret block `name`, or None when there is no such block."""
    from prefect.blocks.system import Secret

    try:
        block = Secret.load(name, _sync=True)
    except ValueError as e:  # Block.load: "Unable to find block document named ..."
        if "Unable to find" in str(e):
            return None
        raise
    # the stored string itself: Secret.get() would json-parse it (a hex password such as "1234e567..." is
    # a JSON number)
    return str(block.value.get_secret_value())


def mlflow_credentials_from_prefect(log: logging.Logger | logging.LoggerAdapter | None = None) -> str | None:
    """At a flow run's start: when the environment has no MLflow credentials (MLFLOW_TRACKING_PASSWORD or
    MLFLOW_TRACKING_TOKEN), the tracking server is an HTTP one and a Prefect server is configured, set
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD from the Prefect Secret blocks USERNAME_BLOCK
    (default DEFAULT_USERNAME when absent) and PASSWORD_BLOCK. Returns the user name it set, or None when it
    set nothing (credentials already there, no password block: a stack without MLflow auth, a local store).
    Errors other than a missing block (the API refused the read) are raised: a flow run that would
    otherwise fail later with MLflow's 401 stops here, naming the block."""
    env = os.environ
    if env.get("MLFLOW_TRACKING_PASSWORD") or env.get("MLFLOW_TRACKING_TOKEN"):
        return None
    if not env.get("MLFLOW_TRACKING_URI", "").startswith(("http://", "https://")):
        return None  # a file or SQLite store, or the local demo server: nothing to authenticate to
    if not _prefect_api_url():
        return None  # no Prefect server (an ephemeral API holds no blocks worth reading)
    try:
        password = _load_secret(PASSWORD_BLOCK)
        if password is None:
            return None
        username = env.get("MLFLOW_TRACKING_USERNAME") or _load_secret(USERNAME_BLOCK) or DEFAULT_USERNAME
    except Exception as e:
        raise RuntimeError(f"cannot read the Prefect Secret blocks {USERNAME_BLOCK!r} / {PASSWORD_BLOCK!r} "
                           f"for the MLflow credentials: {e}") from e
    env["MLFLOW_TRACKING_USERNAME"] = username
    env["MLFLOW_TRACKING_PASSWORD"] = password
    if log is not None:
        log.info("MLflow credentials of user %r from the Prefect Secret blocks %s / %s", username,
                 USERNAME_BLOCK, PASSWORD_BLOCK)
    return username


def save_mlflow_credentials(username: str, password: str) -> None:
    """Save (or replace) the two Secret blocks on the configured Prefect server."""
    from prefect.blocks.system import Secret

    if not username or not password:
        raise ValueError("both an MLflow user name and a password are needed")
    Secret(value=username).save(USERNAME_BLOCK, overwrite=True, _sync=True)
    Secret(value=password).save(PASSWORD_BLOCK, overwrite=True, _sync=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["save-mlflow"]:
        print("usage: python -m integrations.secrets save-mlflow\n  saves MLFLOW_TRACKING_USERNAME (default "
              f"{DEFAULT_USERNAME}) and MLFLOW_TRACKING_PASSWORD from the environment as the Prefect Secret "
              f"blocks {USERNAME_BLOCK} / {PASSWORD_BLOCK}", file=sys.stderr)
        return 2
    username = os.environ.get("MLFLOW_TRACKING_USERNAME") or DEFAULT_USERNAME
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
    if not password:
        print("error: MLFLOW_TRACKING_PASSWORD is not set; export it (the worker's MLflow password, "
              "MLFLOW_WORKER_PASSWORD in docker/.env) and run again", file=sys.stderr)
        return 2
    if not _prefect_api_url():
        print("error: PREFECT_API_URL is not set; point it at the Prefect server the flow runs use "
              "(and PREFECT_API_AUTH_STRING when it has basic auth)", file=sys.stderr)
        return 2
    save_mlflow_credentials(username, password)
    print(f"saved the Prefect Secret blocks {USERNAME_BLOCK} ({username}) and {PASSWORD_BLOCK} at "
          f"{_prefect_api_url()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
