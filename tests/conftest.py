"""Fixtures shared by test modules. `prefect_stack` (a real Prefect server + worker + MLflow server, one
per session) is only started by the tests that ask for it; `standin` is the Hugging Face hub stand-in."""

from tests.hub_standin import standin  # noqa: F401
from tests.prefect_stack import prefect_stack  # noqa: F401
