#!/bin/sh
# Make an importable copy of probe at a git commit under the name `probe_before`, for
# `benchmarks/overhead.py --before probe_before` (both versions side by side in one process).
# Usage: benchmarks/before.sh COMMIT DIR; then PYTHONPATH=$PWD:DIR python benchmarks/overhead.py --before probe_before
set -eu
commit=$1
dir=$2
rm -rf "$dir/probe_before"
mkdir -p "$dir"
git archive "$commit" probe | tar -x -C "$dir"
mv "$dir/probe" "$dir/probe_before"
# absolute imports of the package: `probe.` / `import probe` -> probe_before
find "$dir/probe_before" -name '*.py' -exec sed -i -E \
  -e 's/(from|import) probe(\.| |$)/\1 probe_before\2/g' \
  -e 's/"probe\.([a-z_.]+)"/"probe_before.\1"/g' {} +
echo "$dir/probe_before"
