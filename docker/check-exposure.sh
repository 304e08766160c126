#!/usr/bin/env bash
# Refuse to start a stack whose servers other machines can reach without authentication.
# Run by the compose stack's `exposure-check` service before the Prefect and MLflow servers start:
# with BIND_ADDRESS a loopback address (the default) nothing is required; with any other address,
# docker/.env must set PREFECT_AUTH_STRING (user:password), MLFLOW_ADMIN_PASSWORD,
# MLFLOW_WORKER_PASSWORD and PREFECT_SERVER_ENCRYPTION_KEY (a Fernet key: without it Prefect keeps the key
# to its Secret blocks in its own database), and every password it sets (those, POSTGRES_PASSWORD,
# PREFECT_DB_PASSWORD, MLFLOW_DB_PASSWORD, MLFLOW_SECRET_KEY) must be at least 16 characters and not
# docker/.env.example's placeholder (`change-me...`, `<openssl rand ...>`).
# Credentials alone go over the network in clear text: an exposed stack also needs https (TLS_CERT_FILE and
# TLS_KEY_FILE), or ALLOW_PLAIN_HTTP=1 stating that the network between it and its clients is trusted.
# Each problem is one line naming the variable and the fix; exit 1 when there is any.
set -euo pipefail

addr=${BIND_ADDRESS:-127.0.0.1}
case "$addr" in
    127.*|localhost|::1|"[::1]") exit 0 ;;
esac

min=16
fix="set it to a fresh random value, e.g. \`openssl rand -hex 16\`"
problems=()
# check NAME VALUE REQUIRED: one line in `problems` for a missing, placeholder or short secret
check() {
    local name=$1 value=$2 required=$3
    if [ -z "$value" ]; then
        [ "$required" = 0 ] || problems+=("$name is not set: $fix")
    elif [[ "$value" == *change-me* || "$value" == *changeme* || "$value" == *"<"* || "$value" == *">"* ]]; then
        problems+=("$name is still a docker/.env.example placeholder (change-me..., <...>): $fix")
    elif [ "${#value}" -lt "$min" ]; then
        problems+=("$name is ${#value} characters long, fewer than $min: $fix")
    fi
}
auth=${PREFECT_AUTH_STRING:-}
if [ -z "$auth" ]; then
    problems+=("PREFECT_AUTH_STRING is not set: set it to admin:<password>, the password from \`openssl rand -hex 16\`")
elif [[ "$auth" != ?*:?* ]]; then
    problems+=("PREFECT_AUTH_STRING is not user:password: set it to admin:<password>, the password from \`openssl rand -hex 16\`")
else
    check "PREFECT_AUTH_STRING (its password, after the ':')" "${auth#*:}" 1
fi
check MLFLOW_ADMIN_PASSWORD "${MLFLOW_ADMIN_PASSWORD:-}" 1
check MLFLOW_WORKER_PASSWORD "${MLFLOW_WORKER_PASSWORD:-}" 1
check POSTGRES_PASSWORD "${POSTGRES_PASSWORD:-}" 0  # compose itself refuses an unset one
check PREFECT_DB_PASSWORD "${PREFECT_DB_PASSWORD:-}" 0  # (the same)
check MLFLOW_DB_PASSWORD "${MLFLOW_DB_PASSWORD:-}" 0
check MLFLOW_SECRET_KEY "${MLFLOW_SECRET_KEY:-}" 0   # optional: a random key per start when unset
# Prefect's key for Secret blocks, outside the database that holds them: a Fernet key (32 bytes, url-safe
# base64: 43 characters and '=')
keyfix="set it to a new Fernet key: \`openssl rand -base64 32 | tr '+/' '-_'\` (docs/security.md)"
enc=${PREFECT_SERVER_ENCRYPTION_KEY:-}
if [ -z "$enc" ]; then
    problems+=("PREFECT_SERVER_ENCRYPTION_KEY is not set, so Prefect would keep the key to its Secret blocks in its own database: $keyfix")
elif ! [[ "$enc" =~ ^[A-Za-z0-9_-]{43}=$ ]]; then
    problems+=("PREFECT_SERVER_ENCRYPTION_KEY is not a Fernet key (44 characters of url-safe base64): $keyfix")
fi
cert=${TLS_CERT_FILE:-} key=${TLS_KEY_FILE:-}
if [[ ( -n "$cert" && -z "$key" ) || ( -z "$cert" && -n "$key" ) ]]; then
    problems+=("https needs both TLS_CERT_FILE and TLS_KEY_FILE; only one is set: set the other (absolute paths on this host)")
elif [ -z "$cert" ] && [ "${ALLOW_PLAIN_HTTP:-}" != 1 ]; then
    problems+=("TLS_CERT_FILE and TLS_KEY_FILE are not set, so passwords would cross the network in clear text: set them to your certificate and key (absolute paths on this host; docs/security.md), or set ALLOW_PLAIN_HTTP=1 if every network between the stack and its clients is trusted")
fi
if [ ${#problems[@]} -gt 0 ]; then
    {
        echo "error: BIND_ADDRESS=$addr publishes the Prefect and MLflow servers beyond this machine, but" \
             "docker/.env is not ready for that:"
        printf '  - %s\n' "${problems[@]}"
        echo "Fix them in docker/.env (they turn on authentication), or keep BIND_ADDRESS=127.0.0.1 and" \
             "reach the UIs through an SSH tunnel. Changing a password later: docs/security.md."
    } >&2
    exit 1
fi
if [ -n "$cert" ]; then scheme=https; else scheme="plain http (ALLOW_PLAIN_HTTP=1)"; fi
echo "BIND_ADDRESS=$addr: Prefect basic auth and MLflow's basic-auth app are on, over $scheme"
