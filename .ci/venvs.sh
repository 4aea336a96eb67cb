# Sourced by .ci/install-matrix, .ci/pythons and .ci/torch: the environments CI tests in
# beside python3 (3.11, which runs tests/run_suite.py with PyTorch 2.13.0, the CPU
# build), each a virtual environment kept between runs under $NUMAFAST_CI_VENVS
# (default ~/.cache/numafast-ci):
# - CI_PYTHONS: one per other Python run of the host tests (.ci/pythons). The first
#   gets pyproject.toml's lowest versions (.ci/floors.py), torch's among them (2.11,
#   a CUDA build from PyPI, that imports without a GPU); the others the newest, and
#   no torch. 3.11 is the lowest Python numafast supports (3.10 reached its end of
#   life on 2026-10-31), and the newest Python that numpy's floor (1.24) installs on.
# - CI_TORCH_NEWEST: the newest torch CI tests, under Python 3.11, on the torch test
#   files alone (.ci/torch): the newest that `pip install torch` gets here (2.14.1,
#   a file on this machine's disk; /etc/xdg/pip/constraints.txt caps torch there).
CI_PYTHONS=(3.11 3.12 3.13)
CI_TORCH_NEWEST=2.14.1
CI_TORCH_PYTHON=3.11
CI_VENVS=${NUMAFAST_CI_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/numafast-ci}

ci_venv() {
    echo "$CI_VENVS/python$1"
}

ci_torch_venv() {
    echo "$CI_VENVS/torch-$CI_TORCH_NEWEST"
}

# The newest interpreter of version $1 (3.11): pyenv's, else python3.11 on PATH.
ci_interpreter() {
    local root candidate
    root=$( (pyenv root 2>/dev/null) || echo "$HOME/.pyenv")
    candidate=$(ls -d "$root"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$candidate" ]; then
        echo "$candidate"
        return 0
    fi
    for candidate in $(type -ap "python$1"); do  # pyenv's shims only point into versions/
        [[ "$candidate" == */shims/* ]] || { echo "$candidate"; return 0; }
    done
    return 1
}

# A private copy of the working tree (tracked files and untracked ones git does not
# ignore, so no built extension and no src/_libnuma.c) in a new folder under /tmp,
# printed: .ci/pythons builds and tests there, leaving the tree's own extension, the
# one python3 and .ci/torch import, as .ci/install built it.
ci_tree_copy() {
    local copy
    copy=$(mktemp -d /tmp/numafast-ci-tree.XXXXXX)
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        # --ignore-failed-read: a tracked file deleted in the working tree is left out.
        git ls-files -z --cached --others --exclude-standard --deduplicate \
            | tar --null --files-from=- --ignore-failed-read -cf - | tar -xf - -C "$copy"
    else
        tar --exclude=.git --exclude=build --exclude=dist --exclude=wheelhouse --exclude='*.so' \
            --exclude=src/_libnuma.c -cf - . | tar -xf - -C "$copy"
    fi
    echo "$copy"
}
