#!/bin/sh
# Start the MLflow tracking server: compose's `mlflow` service runs this script, and so does devstack (the
# demo and the tests), so what the tests start is what production starts.
#
# Env (defaults: compose's layout):
#   PYTHON                     the interpreter with mlflow (default python)
#   MLFLOW_HOST, MLFLOW_PORT, MLFLOW_WORKERS    0.0.0.0, 5000, 2
#   MLFLOW_ARTIFACTS_DIR       /mlartifacts, served to clients through the artifact proxy
#   MLFLOW_BACKEND_STORE_URI   the tracking database; unset: compose's PostgreSQL, from POSTGRES_USER
#                              (mlflow: its own role, docker/postgres-init.sql), POSTGRES_PASSWORD,
#                              POSTGRES_HOST (postgres), POSTGRES_PORT (5432), database mlflow.
#                              `mlflow server` reads it from its environment, so the password never
#                              reaches its argv (visible in `ps` on the host).
#   MLFLOW_ADMIN_PASSWORD      set: MLflow's basic-auth app. Admin `admin` (created on the first start),
#                              signed-in users may do nothing they were not granted (NO_PERMISSIONS: the
#                              worker gets its share from integrations.mlflow_store.ensure_user), anonymous
#                              requests get 401.
#   MLFLOW_AUTH_DIR            /mlflow-auth: the user database (mode 0700), never under MLFLOW_ARTIFACTS_DIR:
#                              any file there can be downloaded and replaced through the artifact proxy
#   MLFLOW_AUTH_CONFIG         /tmp/basic_auth.ini: the basic-auth settings written here (mode 0600: it
#                              holds the admin password)
#   MLFLOW_FLASK_SERVER_SECRET_KEY   signs UI sessions; unset: a random one per start
#   TLS_CERT_FILE, TLS_KEY_FILE      both set: https (uvicorn's TLS), else plain http
#   MLFLOW_SERVER_ENABLE_JOB_EXECUTION   default false here (MLflow's is true): the server's job runner is
#                              for GenAI jobs (scorers, trace roll-ups) this pipeline never submits, and it
#                              costs 7 huey consumer processes per server, each importing mlflow (~24 s of
#                              CPU at every start, ~1.4 GiB of memory; docs/testing.md). true turns it back on.
# Bad settings exit 2 with the fix.
set -eu

die() { echo "start-mlflow: $*" >&2; exit 2; }
py=${PYTHON:-python}
artifacts=${MLFLOW_ARTIFACTS_DIR:-/mlartifacts}

if [ -z "${MLFLOW_BACKEND_STORE_URI:-}" ]; then
    [ -n "${POSTGRES_PASSWORD:-}" ] || die "set MLFLOW_BACKEND_STORE_URI, or POSTGRES_PASSWORD for compose's PostgreSQL"
    MLFLOW_BACKEND_STORE_URI="postgresql+psycopg2://${POSTGRES_USER:-mlflow}:${POSTGRES_PASSWORD}@${POSTGRES_HOST:-postgres}:${POSTGRES_PORT:-5432}/mlflow"
fi
export MLFLOW_BACKEND_STORE_URI
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION

set -- --host "${MLFLOW_HOST:-0.0.0.0}" --port "${MLFLOW_PORT:-5000}" --workers "${MLFLOW_WORKERS:-2}" \
    --serve-artifacts --artifacts-destination "$artifacts"

if [ -n "${MLFLOW_ADMIN_PASSWORD:-}" ]; then
    auth=${MLFLOW_AUTH_DIR:-/mlflow-auth}
    config=${MLFLOW_AUTH_CONFIG:-/tmp/basic_auth.ini}
    case "${auth%/}/" in
        "${artifacts%/}"/*) die "MLFLOW_AUTH_DIR=$auth is inside MLFLOW_ARTIFACTS_DIR=$artifacts, which the server serves: put it beside it" ;;
    esac
    umask 077
    mkdir -p "$auth"
    chmod 700 "$auth"
    # an older stack kept the database in the served folder: it moves out (users, passwords, grants carry over)
    if [ -f "$artifacts/basic_auth.db" ] && [ ! -e "$auth/basic_auth.db" ]; then
        mv "$artifacts/basic_auth.db" "$auth/"
    fi
    printf '[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///%s\nadmin_username = admin\nadmin_password = %s\nauthorization_function = mlflow.server.auth:authenticate_request_basic_auth\n' \
        "$auth/basic_auth.db" "$MLFLOW_ADMIN_PASSWORD" > "$config"
    export MLFLOW_AUTH_CONFIG_PATH="$config"
    # MLflow's basic-auth app + one rule: only an admin chooses an experiment's artifact_location
    # (integrations/mlflow_app.py, the `mlflow.app` entry point `gptpipe-auth` of this project)
    set -- --app-name gptpipe-auth "$@"
    if [ -z "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ]; then
        MLFLOW_FLASK_SERVER_SECRET_KEY=$("$py" -c 'import secrets; print(secrets.token_hex(16))')
        export MLFLOW_FLASK_SERVER_SECRET_KEY
    fi
fi

if [ -n "${TLS_CERT_FILE:-}${TLS_KEY_FILE:-}" ]; then
    for f in "${TLS_CERT_FILE:-}" "${TLS_KEY_FILE:-}"; do
        [ -f "$f" ] && [ -r "$f" ] || die "https needs TLS_CERT_FILE and TLS_KEY_FILE, both readable files; got '${TLS_CERT_FILE:-}' and '${TLS_KEY_FILE:-}'"
    done
    set -- "$@" --uvicorn-opts "--ssl-certfile $TLS_CERT_FILE --ssl-keyfile $TLS_KEY_FILE"
fi

exec "$py" -m mlflow server "$@"
