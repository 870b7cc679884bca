# Sourced by the setup scripts whose torch is the cp311 CPU wheel: sets PY311 to a Python 3.11 that really runs (a
# pyenv shim may exist but refuse), or exits with a message naming the caller ($1).
PY311=${PYTHON311:-}
if [ -z "$PY311" ]; then
    for candidate in "$(pyenv root 2>/dev/null)"/versions/3.11*/bin/python3.11 /usr/bin/python3.11 python3.11; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
            PY311=$candidate
            break
        fi
    done
fi
[ -n "$PY311" ] || { echo "$1: Python 3.11 is required (the CPU torch wheel is cp311)" >&2; exit 1; }
