#!/usr/bin/env bash
# Install requirements with the project's lock (constraints.txt), keeping the torch the image already has.
#
#   install-locked.sh LOCK [--deps-of pyproject.toml] [pip install args ...]
#
# The lock pins torch==2.13.0, which on PyPI's default index is the build proven on the developers' CPU
# machines. A CUDA base image (pytorch/pytorch:...) ships its own CUDA build of torch; installing the
# lock as-is would replace it. So when torch is importable, the lock's torch line is swapped for the
# installed version (e.g. torch==2.13.0+cu128): pip then keeps it and resolves everything else against
# the lock. Without an installed torch the lock is used unchanged.
#
#   --deps-of FILE   also install the [project].dependencies listed in FILE (lets the Dockerfile install
#                    the dependency layer before copying the source, so code edits don't reinstall them)
# Env: PYTHON (default python), LOCK_OUT (keep the effective constraints file at this path).
set -euo pipefail

die() { echo "install-locked: $*" >&2; exit 2; }

[ $# -ge 1 ] || die "usage: install-locked.sh LOCK [--deps-of pyproject.toml] [pip install args ...]"
lock=$1; shift
[ -f "$lock" ] || die "lock file $lock not found; pass the project's constraints.txt"
py=${PYTHON:-python}

reqs=()
if [ "${1:-}" = "--deps-of" ]; then
    [ -f "${2:-}" ] || die "--deps-of needs an existing pyproject.toml, got '${2:-}'"
    mapfile -t reqs < <("$py" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$2")
    shift 2
fi
[ $# -gt 0 ] || [ ${#reqs[@]} -gt 0 ] || die "nothing to install: give --deps-of FILE and/or requirements"

out=${LOCK_OUT:-$(mktemp)}
base_torch=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ -n "$base_torch" ]; then
    lock_torch=$(grep -E '^torch==' "$lock" | head -n1 || true)
    grep -v -E '^torch==' "$lock" > "$out"
    echo "torch==$base_torch" >> "$out"
    echo "install-locked: keeping the installed torch $base_torch (lock says ${lock_torch:-no torch pin})"
else
    cp "$lock" "$out"
    echo "install-locked: no torch installed; using the lock as is"
fi

"$py" -m pip install --no-cache-dir -c "$out" ${reqs[@]+"${reqs[@]}"} "$@"
[ -n "${LOCK_OUT:-}" ] || rm -f "$out"
