#!/usr/bin/env bash
# Fetch karpathy/build-nanogpt at a pinned commit into reference/build-nanogpt (ignored by git: its code
# stays out of this repository). gpu_check's reference row runs its train_gpt2.py from there:
#   python -m benchmarks.gpu_check --reference reference/build-nanogpt/train_gpt2.py
# On the GPU lease, carry the folder with the working tree (device `carry: ["reference"]`).
# SOURCE may be a local clone or mirror (an air-gapped machine); default: GitHub.
set -euo pipefail
COMMIT=6104ab1b53920f6e2159749676073ff7d815c1fa  # "fix guard of torch.cuda based on device type"
SOURCE=${SOURCE:-https://github.com/karpathy/build-nanogpt.git}
cd "$(dirname "$0")/.."
dest=reference/build-nanogpt
tmp=$(mktemp -d reference.XXXXXX.tmp)
trap 'rm -rf "$tmp"' EXIT
git clone --quiet --no-checkout "$SOURCE" "$tmp/repo"
git -C "$tmp/repo" -c advice.detachedHead=false checkout --quiet "$COMMIT" -- train_gpt2.py hellaswag.py
mkdir -p reference
rm -rf "$dest"
mkdir "$tmp/out" && cp "$tmp/repo/train_gpt2.py" "$tmp/repo/hellaswag.py" "$tmp/out/"
echo "$COMMIT" > "$tmp/out/COMMIT"
mv "$tmp/out" "$dest"  # whole or not at all
echo "fetched build-nanogpt $COMMIT into $dest"
