"""Fixtures shared by test modules. `prefect_stack` (a real Prefect server + worker + MLflow server, one
per session) is only started by the tests that ask for it."""

from tests.prefect_stack import prefect_stack  # noqa: F401
