"""The suite's check of the Prefect server log (tests/prefect_stack.py): which ERROR records fail a stack's
teardown. Known contention of SQLite in Prefect's own loops is allowed; the same error where a client would
see it, or any other error, is not."""
from types import SimpleNamespace

from tests.prefect_stack import server_log_errors, unexpected_server_errors

LOCKED = ("Traceback (most recent call last):\n"
          "  File \"sqlalchemy/engine/base.py\", line 2000, in _exec_single_context\n"
          "sqlite3.OperationalError: database is locked\n"
          "sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) database is locked\n"
          "[SQL: UPDATE {table} SET status=:status WHERE {table}.id = :id_1]\n")


def _stack_with_log(tmp_path, text):
    (tmp_path / "prefect-server.log").write_text(text)
    return SimpleNamespace(state_dir=tmp_path)


def test_a_perpetual_service_losing_a_pass_to_sqlite_is_known_and_a_request_is_not(tmp_path):
    log = ("04:53:50.001 | INFO    | prefect.server - started\n"
           "04:53:51.737 | ERROR   | docket.dependencies - ↩ [    37ms] monitor_worker_health()\n"
           + LOCKED.format(table="work_pool") +
           "04:53:52.000 | ERROR   | prefect.server - Encountered exception in request:\n"
           + LOCKED.format(table="flow_run") +
           "04:53:53.000 | ERROR   | prefect.server.services.scheduler - Unexpected error in: schedule\n"
           "sqlalchemy.exc.InvalidRequestError: Can't evaluate bulk DML statement\n"
           "04:53:54.000 | INFO    | prefect.server - the end\n")
    stack = _stack_with_log(tmp_path, log)
    assert len(server_log_errors(stack)) == 3
    unexpected = unexpected_server_errors(stack)
    assert [e.splitlines()[0][13:] for e in unexpected] == [
        "| ERROR   | prefect.server - Encountered exception in request:",
        "| ERROR   | prefect.server.services.scheduler - Unexpected error in: schedule"]
    assert "UPDATE flow_run" in unexpected[0] and "the end" not in unexpected[1]


def test_a_perpetual_service_failing_otherwise_is_not_known(tmp_path):
    log = ("04:53:51.737 | ERROR   | docket.dependencies - ↩ [    37ms] monitor_worker_health()\n"
           "KeyError: 'status'\n")
    assert len(unexpected_server_errors(_stack_with_log(tmp_path, log))) == 1


def test_a_worker_channel_set_up_lost_to_sqlite_is_known_and_lost_otherwise_is_not(tmp_path):
    """Prefect closes the channel with TRANSIENT_SERVER_ERROR (retryable: the worker connects again); the same
    set-up failing for any other reason is a failure (CI, 2026-11-29)."""
    head = "13:32:37.890 | ERROR   | prefect.server.api.workers - Worker channel setup failed due to a transient " \
           "server error: work_pool=cpu-pool\n"
    locked = _stack_with_log(tmp_path, head + LOCKED.format(table="work_pool"))
    assert len(server_log_errors(locked)) == 1 and unexpected_server_errors(locked) == []
    other = tmp_path / "other"
    other.mkdir()
    assert len(unexpected_server_errors(_stack_with_log(other, head + "KeyError: 'initial_snapshot'\n"))) == 1
