# Sourced by .ci/install and .ci/pythons: the Pythons CI tests beside python3
# (3.11, which runs tests/run_suite.py), each in a virtual environment kept
# between runs under $NUMAFAST_CI_VENVS (default ~/.cache/numafast-ci). The
# first gets pyproject.toml's lowest versions (.ci/floors.py).
CI_PYTHONS=(3.10 3.12 3.13)
CI_VENVS=${NUMAFAST_CI_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/numafast-ci}

ci_venv() {
    echo "$CI_VENVS/python$1"
}

# The newest interpreter of version $1 (3.10): pyenv's, else python3.10 on PATH.
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
