#!/bin/sh
# The stand-in PostgreSQL image's entrypoint (docker/standin-bases.sh): the part of the official postgres
# image's contract docker/docker-compose.yml relies on. On an empty PGDATA: initdb with POSTGRES_USER as the
# superuser (password POSTGRES_PASSWORD, scram-sha-256 for every network connection), the database
# POSTGRES_DB, then each /docker-entrypoint-initdb.d/*.sql run with `psql -v ON_ERROR_STOP=1 -f` as that
# user in that database; then the server, listening on every address.
set -eu
: "${PGDATA:=/var/lib/postgresql/data}" "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
[ -n "${POSTGRES_PASSWORD:-}" ] || { echo "standin-postgres: POSTGRES_PASSWORD is required" >&2; exit 2; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -k /var/run/postgresql" -w start >/dev/null
    psql -h /var/run/postgresql -U "$POSTGRES_USER" -d postgres -v ON_ERROR_STOP=1 -q -c "CREATE DATABASE \"$POSTGRES_DB\"" \
        2>/dev/null || true  # exists when POSTGRES_DB is the user's own (initdb made `postgres` only)
    for f in /docker-entrypoint-initdb.d/*.sql; do
        [ -e "$f" ] || continue
        echo "standin-postgres: running $f"
        psql -h /var/run/postgresql -U "$POSTGRES_USER" -d "$POSTGRES_DB" -v ON_ERROR_STOP=1 -q -f "$f"
    done
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -k /var/run/postgresql
