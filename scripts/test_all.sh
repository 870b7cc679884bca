#!/usr/bin/env bash
# `make test-all` (and CI): every test, in three groups, with hypothesis's `ci` profile.
#   1. parallel: everything that may run beside another test (`not serial`), on pytest-xdist workers, while the
#      real-vLLM environment installs in the background (downloads and unpacking, little CPU);
#   2. serial: the tests that own the machine (the fleet, the real CLIs, crash and soak runs: tests/full/), one at a
#      time;
#   3. e2e: real vLLM servers on the CPU (tests/e2e/): a tiny Qwen3, and a tiny Qwen2.5-VL for images;
#   4. trainers: verl's and slime's loaders in the trainer environment (verl from PyPI, the CPU torch), installed in
#      the background after the vLLM one (tests/trainer_checks/).
# The markers choose the tests; each folder holds its tier's (tests/fast/test_layers.py checks it).
# Each group reports its 25 slowest tests; the last line adds up all three. A failed group does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${WORKERS:-auto}
REPORTS=${TITO_TEST_REPORTS:-build/test-reports}
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
COMMON=(--hypothesis-profile=ci --durations=25)

(
    bash scripts/setup_vllm_cpu.sh >"$REPORTS/setup_vllm.log" 2>&1
    echo $? >"$REPORTS/setup_vllm.rc"
    bash scripts/setup_vllm_vl.sh >"$REPORTS/setup_vllm_vl.log" 2>&1
    echo $? >"$REPORTS/setup_vllm_vl.rc"
    bash scripts/setup_trainers.sh >"$REPORTS/setup_trainers.log" 2>&1
    echo $? >"$REPORTS/setup_trainers.rc"
) &
setup=$!
failed=()
"$PY" -m pytest -n "$WORKERS" --dist loadfile -m 'not serial and not e2e and not trainers' "${COMMON[@]}" \
    --junitxml="$REPORTS/parallel.xml" || failed+=(parallel)
wait "$setup"
for env in vllm vllm_vl trainers; do
    if [ "$(cat "$REPORTS/setup_$env.rc" 2>/dev/null)" != 0 ]; then
        cat "$REPORTS/setup_$env.log" >&2
        failed+=("setup-$env")
    fi
done
# The serial tier starts each mitmdump from scratch, as a user's shell does; the others fork them from a warmed
# interpreter (tests/conftest.py, `tito_addon/replicas/mitmdump_forks.py`).
TITO_MITMDUMP_FORKS=0 "$PY" -m pytest -m 'serial and not e2e and not trainers' "${COMMON[@]}" \
    --junitxml="$REPORTS/serial.xml" || failed+=(serial)
"$PY" -m pytest -m e2e "${COMMON[@]}" --junitxml="$REPORTS/e2e.xml" || failed+=(e2e)
"$PY" -m pytest -m trainers "${COMMON[@]}" --junitxml="$REPORTS/trainers.xml" || failed+=(trainers)
"$PY" scripts/test_totals.py "$REPORTS"/parallel.xml "$REPORTS"/serial.xml "$REPORTS"/e2e.xml \
    "$REPORTS"/trainers.xml || failed+=(totals)
if [ ${#failed[@]} -gt 0 ]; then
    echo "test-all: failed: ${failed[*]}" >&2
    exit 1
fi
