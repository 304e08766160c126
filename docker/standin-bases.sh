#!/usr/bin/env bash
# Stand-ins for the Dockerfile's base images, made on a machine that reaches Debian's and PyPI's package
# registries but no image registry (CI here): `make test-images` builds docker/Dockerfile unchanged on them,
# through its build args. Where a registry is reachable, build on the real bases instead (docs/docker.md).
#
#   docker/standin-bases.sh      prints SERVICES_BASE=<tag> BASE_IMAGE=<tag> POSTGRES_IMAGE=<tag>
#
#   services  Debian bookworm (debootstrap, minbase) + Debian's python3.11 with pip: the role of
#             python:3.11-slim-bookworm (`python` on PATH; pip may install system-wide, as in that image)
#   trainer   the same + PyPI's CPU torch (TORCH_WHEEL, or torch==TORCH_VERSION from the index): the role of
#             the CUDA PyTorch base; build with REQUIRE_CUDA_TORCH=0
#   postgres  the services stand-in + Debian's postgresql-15 behind docker/standin-postgres-entrypoint.sh:
#             the role of postgres:16-bookworm in the compose stack (POSTGRES_IMAGE)
# Each is tagged by a hash of what goes into it, so a second run finds it and builds nothing.
#
# Env: MIRROR (default http://deb.debian.org/debian), TORCH_VERSION (default 2.13.0), TORCH_WHEEL (a local
# wheel file, optional), WORK (default /var/tmp/gptpipe-standins: the debootstrap tree, kept between runs)
set -euo pipefail

die() { echo "standin-bases: $*" >&2; exit 2; }
command -v docker >/dev/null || die "docker is not installed (Debian: apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "no Docker engine answers (start one: dockerd &)"

mirror=${MIRROR:-http://deb.debian.org/debian}
torch_version=${TORCH_VERSION:-2.13.0}
work=${WORK:-/var/tmp/gptpipe-standins}
packages=python3,python3-pip,python3-venv,ca-certificates

recipe=1  # bump when the way a base is made below changes: the tags (and so the cache) follow it
key=$(echo "$recipe $mirror $packages" | sha256sum | cut -c1-12)
services_tag=gptpipe-standin/python:3.11-bookworm-$key
if ! docker image inspect "$services_tag" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || die "debootstrap is not installed (Debian: apt-get install debootstrap)"
    root=$work/bookworm-$key
    if [ ! -x "$root/usr/bin/python3.11" ]; then
        rm -rf "$root" && mkdir -p "$work"
        echo "standin-bases: debootstrap bookworm into $root (a few minutes)" >&2
        debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >&2
    fi
    # as in the python image: `python` on PATH, pip free to install into the system Python
    ln -sf python3 "$root/usr/bin/python"
    rm -f "$root"/usr/lib/python3.*/EXTERNALLY-MANAGED "$root"/var/cache/apt/archives/*.deb
    # this host's CA bundle: where a registry is reached through a proxy with its own CA, so are the builds'
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$services_tag" >/dev/null
fi

wheel=${TORCH_WHEEL:-}
wheel_key=$( { echo "$services_tag $torch_version"; [ -z "$wheel" ] || sha256sum "$wheel"; } | sha256sum | cut -c1-12)
trainer_tag=gptpipe-standin/torch:$torch_version-cpu-$wheel_key
if ! docker image inspect "$trainer_tag" >/dev/null 2>&1; then
    ctx=$(mktemp -d)
    trap 'rm -rf "$ctx"' EXIT
    if [ -n "$wheel" ]; then
        [ -f "$wheel" ] || die "TORCH_WHEEL=$wheel is not a file"
        ln "$wheel" "$ctx/" 2>/dev/null || cp "$wheel" "$ctx/"
        spec="/tmp/$(basename "$wheel")"
    else
        spec="torch==$torch_version"
    fi
    cat > "$ctx/Dockerfile" <<EOF
FROM $services_tag
COPY . /tmp/
RUN python -m pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu "$spec" \\
    && rm -f /tmp/*.whl && python -c "import torch; print(torch.__version__)"
EOF
    echo "standin-bases: $trainer_tag (torch $torch_version, CPU)" >&2
    docker build -q -t "$trainer_tag" "$ctx" >&2
fi

here=$(cd "$(dirname "$0")" && pwd)
pg_key=$( { echo "$services_tag"; cat "$here/standin-postgres-entrypoint.sh"; } | sha256sum | cut -c1-12)
postgres_tag=gptpipe-standin/postgres:15-$pg_key
if ! docker image inspect "$postgres_tag" >/dev/null 2>&1; then
    pg_ctx=$(mktemp -d)
    cp "$here/standin-postgres-entrypoint.sh" "$pg_ctx/"
    cat > "$pg_ctx/Dockerfile" <<EOF
FROM $services_tag
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 && rm -rf /var/lib/apt/lists/* \\
    && install -d -o postgres -g postgres /var/lib/postgresql/data /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/bin:/usr/bin:/bin PGDATA=/var/lib/postgresql/data
COPY standin-postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
USER postgres
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
EOF
    echo "standin-bases: $postgres_tag (Debian's PostgreSQL 15)" >&2
    docker build -q -t "$postgres_tag" "$pg_ctx" >&2
    rm -rf "$pg_ctx"
fi
echo "SERVICES_BASE=$services_tag BASE_IMAGE=$trainer_tag POSTGRES_IMAGE=$postgres_tag"
