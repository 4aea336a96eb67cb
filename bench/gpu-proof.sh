#!/usr/bin/env bash
# The GPU proof on a GPU machine (bench/gpu_proof.py says what it runs): installs the
# wheel that bench/gpu-kit.sh built into a fresh target folder, leaving the machine's
# own Python and torch as they are, and writes gpu-proof.json to $OUT (else here).
# Where no kit was built, the numafast already importable is proved.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(.gpu-kit/numafast-*.whl)
if [ -e "${wheels[0]}" ]; then
    site=$(mktemp -d /tmp/numafast-site.XXXXXX)
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH
fi
export PYTHONUNBUFFERED=1
exec python3 bench/gpu_proof.py --json "${OUT:-.}/gpu-proof.json" "$@"
