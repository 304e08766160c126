#!/bin/sh
# Start the Prefect server: compose's `prefect-server` service runs this script, and so does devstack (the
# demo and the tests), so what the tests start is what production starts.
#
# Env (defaults: compose's):
#   PYTHON                     the interpreter with prefect (default python)
#   PREFECT_SERVER_API_HOST, PREFECT_SERVER_API_PORT    0.0.0.0, 4200
#   PREFECT_AUTH_STRING        user:password: Prefect's basic auth (PREFECT_SERVER_API_AUTH_STRING); unset or
#                              empty: none (an empty auth string would not mean "off" to Prefect)
#   TLS_CERT_FILE, TLS_KEY_FILE     both set: https, else plain http
#   PREFECT_SERVER_DATABASE_*, PREFECT_HOME, PREFECT_UI_API_URL, ...: Prefect's own settings, as given
# Bad settings exit 2 with the fix.
set -eu

die() { echo "start-prefect-server: $*" >&2; exit 2; }
py=${PYTHON:-python}
PREFECT_SERVER_API_HOST=${PREFECT_SERVER_API_HOST:-0.0.0.0}
PREFECT_SERVER_API_PORT=${PREFECT_SERVER_API_PORT:-4200}
export PREFECT_SERVER_API_HOST PREFECT_SERVER_API_PORT
if [ -n "${PREFECT_AUTH_STRING:-}" ]; then
    export PREFECT_SERVER_API_AUTH_STRING="$PREFECT_AUTH_STRING"
fi

if [ -n "${TLS_CERT_FILE:-}${TLS_KEY_FILE:-}" ]; then
    for f in "${TLS_CERT_FILE:-}" "${TLS_KEY_FILE:-}"; do
        [ -f "$f" ] && [ -r "$f" ] || die "https needs TLS_CERT_FILE and TLS_KEY_FILE, both readable files; got '${TLS_CERT_FILE:-}' and '${TLS_KEY_FILE:-}'"
    done
    # `prefect server start` has no TLS option. Its --background mode runs the server's app factory under
    # `python -m uvicorn`; this is that command with uvicorn's own TLS options added.
    exec "$py" -m uvicorn --factory prefect.server.api.server:create_app \
        --host "$PREFECT_SERVER_API_HOST" --port "$PREFECT_SERVER_API_PORT" \
        --timeout-keep-alive "${PREFECT_SERVER_API_KEEPALIVE_TIMEOUT:-5}" \
        --ssl-certfile "$TLS_CERT_FILE" --ssl-keyfile "$TLS_KEY_FILE"
fi
exec "$py" -m prefect server start --host "$PREFECT_SERVER_API_HOST" --port "$PREFECT_SERVER_API_PORT"
