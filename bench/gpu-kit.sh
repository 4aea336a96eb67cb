#!/usr/bin/env bash
# Builds, here, what the GPU proof needs on a GPU machine that has no network but its
# own Python and torch: numafast as a manylinux wheel with libnuma bundled
# (auditwheel), for that machine's Python (default 3.12, as the lent machines have),
# in .gpu-kit/ (ignored by git; a device run carries it). Then, there:
#   bash bench/gpu-proof.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
source .ci/venvs.sh
interpreter=$(ci_interpreter "$version") || { echo "gpu-kit: no Python $version here (pyenv or python$version)" >&2; exit 1; }
rm -rf .gpu-kit
"$interpreter" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir .gpu-kit/built .
auditwheel repair -w .gpu-kit .gpu-kit/built/*.whl >.gpu-kit/repair.log 2>&1 || { cat .gpu-kit/repair.log; exit 1; }
rm -rf .gpu-kit/built
ls -l .gpu-kit
