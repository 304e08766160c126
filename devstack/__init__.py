"""The local development stack: `make demo` (devstack.demo) and the supervisor of the Prefect server,
worker and MLflow server it starts on 127.0.0.1 (devstack.services). Not used by deployments."""
