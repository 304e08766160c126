#!/usr/bin/env bash
# Start a Prefect worker once the server is up: wait for the API, create the work pool if it is missing,
# then exec `prefect worker start` (so the worker is PID 1's direct replacement and gets the stop signal).
#
# Env:
#   PREFECT_API_URL      required, e.g. http://prefect-server:4200/api
#   WORK_POOL            pool to serve (default gpu-pool: the gpt2-124m deployment's pool)
#   WORK_POOL_TYPE       process | docker | kubernetes (default process: flow runs as subprocesses here)
#   WORK_POOL_TEMPLATE   base job template JSON used when the pool is created (optional)
#   WORKER_NAME          default: the container's hostname
#   API_WAIT_SECONDS     how long to wait for the API (default 180)
#   TLS_CA_FILE          the CA that signed the servers' certificate (https with a private CA); it becomes
#                        PREFECT_API_SSL_CERT_FILE and MLFLOW_TRACKING_SERVER_CERT_PATH for the worker and
#                        its flow runs (never exported empty: MLflow would read "" as "do not verify")
#   DRY_RUN=1            print the prefect commands instead of running them (the wait still runs)
# Extra arguments are passed to `prefect worker start`.
set -euo pipefail

die() { echo "entrypoint-worker: $*" >&2; exit 2; }
log() { echo "entrypoint-worker: $*"; }
run() {
    if [ "${DRY_RUN:-0}" = 1 ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

# Prefect's basic auth (an exposed compose stack): clients send PREFECT_API_AUTH_STRING
if [ -n "${PREFECT_AUTH_STRING:-}" ]; then export PREFECT_API_AUTH_STRING="$PREFECT_AUTH_STRING"; fi
if [ -n "${TLS_CA_FILE:-}" ]; then
    [ -s "$TLS_CA_FILE" ] || die "TLS_CA_FILE=$TLS_CA_FILE is missing or empty; mount the CA certificate there (docker/.env: TLS_CA_FILE)"
    export PREFECT_API_SSL_CERT_FILE="$TLS_CA_FILE" MLFLOW_TRACKING_SERVER_CERT_PATH="$TLS_CA_FILE"
fi
api=${PREFECT_API_URL:-}
[ -n "$api" ] || die "PREFECT_API_URL is not set; set it to the server's API, e.g. http://prefect-server:4200/api"
pool=${WORK_POOL:-gpu-pool}
pool_type=${WORK_POOL_TYPE:-process}
name=${WORKER_NAME:-$(hostname)}
wait_s=${API_WAIT_SECONDS:-180}
[[ "$wait_s" =~ ^[0-9]+$ ]] || die "API_WAIT_SECONDS must be a whole number of seconds, got '$wait_s'"
py=${PYTHON:-python}

# 1. the API answers /health with 200 (python, because the image has no curl)
log "waiting up to ${wait_s}s for the Prefect API at $api"
if ! "$py" - "${api%/}/health" "$wait_s" <<'EOF'
import base64, os, ssl, sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
tls = ssl.create_default_context(cafile=os.environ.get("PREFECT_API_SSL_CERT_FILE") or None)
auth = os.environ.get("PREFECT_API_AUTH_STRING")
while True:
    req = urllib.request.Request(url)
    if auth:  # unredirected: a redirect must not carry the credentials to another host
        req.add_unredirected_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5, context=tls) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    if time.monotonic() >= deadline:
        sys.exit(1)
    time.sleep(1)
EOF
then
    die "the Prefect API at $api did not answer within ${wait_s}s; check that the server is running \
(docker compose logs prefect-server) and that PREFECT_API_URL points at it"
fi
log "Prefect API is up"

# 2. the pool (a concurrent worker may create it between inspect and create: check again on failure)
create=(prefect work-pool create "$pool" --type "$pool_type")
if [ -n "${WORK_POOL_TEMPLATE:-}" ]; then
    [ -f "$WORK_POOL_TEMPLATE" ] || die "WORK_POOL_TEMPLATE=$WORK_POOL_TEMPLATE does not exist"
    create+=(--base-job-template "$WORK_POOL_TEMPLATE")
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
    run prefect work-pool inspect "$pool"
    run "${create[@]}"
elif prefect work-pool inspect "$pool" >/dev/null 2>&1; then
    log "work pool $pool exists"
elif "${create[@]}" || prefect work-pool inspect "$pool" >/dev/null 2>&1; then
    log "work pool $pool ready"
else
    die "could not create work pool $pool of type $pool_type (see the error above)"
fi

# 3. the worker (its healthcheck server answers http://127.0.0.1:8080/health inside the container)
if [ "${DRY_RUN:-0}" = 1 ]; then
    run prefect worker start --pool "$pool" --type "$pool_type" --name "$name" --with-healthcheck "$@"
    exit 0
fi
exec prefect worker start --pool "$pool" --type "$pool_type" --name "$name" --with-healthcheck "$@"
