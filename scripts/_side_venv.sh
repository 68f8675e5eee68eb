# Sourced by the install scripts of kvcert's side environments (.venv-refaware, .venv-vllm): an engine whose pins
# cannot share .venv gets its own venv, with torch==2.13.0 (the CPU build; never unpinned), its pinned set installed
# --no-deps, and kvcert (editable, --no-deps) with its core requirements. Before sourcing, set NAME (the script's
# name, for messages), ROOT, VENV, BASE_PY and REQS. Then:
#
#   side_venv_open "$stamp" || exit 0     # 1 when $VENV's stamp is $stamp already (nothing to do)
#   side_torch                            # torch 2.13.0 (CPU), and torch_before
#   pip_install --no-deps -r "$REQS"      # the engine's set; then whatever the engine needs done in place
#   side_kvcert                           # kvcert and its core requirements; the engine's pins kept; torch unchanged
#   side_venv_close "$stamp"
#
# The stamp should cover this file: `side_venv_inputs` prints it with the requirements every side venv reads.

PY="$VENV/bin/python"
STAMP_FILE="$VENV/.kvcert-$NAME-stamp"

if grep -Eiq '^[[:space:]]*torch([[:space:]]*[=<>!~;]|[[:space:]]*$)' "$REQS"; then
    echo "install_$NAME: refusing: $REQS names torch; torch is installed separately" >&2
    exit 2
fi

side_venv_inputs() {
    cat "$REQS" "$ROOT/requirements/core.txt" "$ROOT/requirements/constraints.txt" "$ROOT/pyproject.toml" \
        "$ROOT/scripts/_side_venv.sh"
}

side_venv_open() {
    if [[ -x "$PY" && "$(cat "$STAMP_FILE" 2>/dev/null || true)" == "$1" ]]; then
        echo "install_$NAME: $VENV is up to date" >&2
        return 1
    fi
    if [[ ! -x "$PY" ]]; then
        echo "install_$NAME: creating $VENV" >&2
        "$BASE_PY" -m venv "$VENV"
    fi
    rm -f "$STAMP_FILE"
}

pip_install() {
    "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
        | grep -v -e "is ignored: it is neither a file nor a directory" -e "requires .*, which is not installed" \
            -e "but you have .* which is incompatible" -e "pip's dependency resolver does not currently" || true
}

torch_version() { "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null; }

side_torch() {
    if [[ "$(torch_version || true)" != 2.13.0* ]]; then
        echo "install_$NAME: installing torch==2.13.0 (CPU build)" >&2
        # torch's own dependencies (filelock, sympy, ...) pinned by the tested set
        pip_install -c "$ROOT/requirements/constraints.txt" torch==2.13.0
    fi
    torch_before="$(torch_version)" || { echo "install_$NAME: torch is not importable" >&2; exit 1; }
}

side_kvcert() {
    echo "install_$NAME: installing kvcert (--no-deps, editable) and its core requirements" >&2
    pip_install -c "$ROOT/requirements/constraints.txt" -r "$ROOT/requirements/core.txt"
    pip_install --no-deps -e "$ROOT"
    # core.txt must not have replaced one of the engine's pins (a second --no-deps pass is a no-op then)
    pip_install --no-deps -r "$REQS"
    if [[ "$(torch_version)" != "$torch_before" ]]; then
        echo "install_$NAME: torch changed from $torch_before to $(torch_version); this must not happen" >&2
        exit 1
    fi
}

side_venv_close() { echo "$1" > "$STAMP_FILE"; }
