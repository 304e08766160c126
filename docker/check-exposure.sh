#!/usr/bin/env bash
# Refuse to start a stack whose servers other machines can reach without authentication.
# Run by the compose stack's `exposure-check` service before the Prefect and MLflow servers start:
# with BIND_ADDRESS a loopback address (the default) nothing is required; with any other address,
# docker/.env must set PREFECT_AUTH_STRING (user:password), MLFLOW_ADMIN_PASSWORD and
# MLFLOW_WORKER_PASSWORD (each >= 12 characters: MLflow's basic-auth app refuses shorter ones).
set -euo pipefail

addr=${BIND_ADDRESS:-127.0.0.1}
case "$addr" in
    127.*|localhost|::1|"[::1]") exit 0 ;;
esac

problems=()
[[ "${PREFECT_AUTH_STRING:-}" == ?*:?* ]] || problems+=("PREFECT_AUTH_STRING (user:password)")
for var in MLFLOW_ADMIN_PASSWORD MLFLOW_WORKER_PASSWORD; do
    [ "$(printf %s "${!var:-}" | wc -c)" -ge 12 ] || problems+=("$var (>= 12 characters)")
done
if [ ${#problems[@]} -gt 0 ]; then
    echo "error: BIND_ADDRESS=$addr publishes the Prefect and MLflow servers beyond this machine, but" \
         "docker/.env does not set: ${problems[*]}. Set them (e.g. \`openssl rand -hex 16\` for each password)" \
         "to turn on authentication, or keep BIND_ADDRESS=127.0.0.1 and use an SSH tunnel." >&2
    exit 1
fi
echo "BIND_ADDRESS=$addr: Prefect basic auth and MLflow's basic-auth app are on"
