#!/usr/bin/env bash
# The suite against the other onnxruntime versions sharedml accepts, each in its own venv (the
# newest is .ci/run's main run): 1.24.4, the last onnxruntime-directml release, which every
# DirectML user runs, and the floor of pyproject.toml on a quick subset. Tests that need a
# capability the version lacks skip with its reason (tests/conftest.py, `capability` marker).
#
# Budget: about 6-7 minutes of .ci/run's 25 on 2 cores. 1.24.4 runs everything but the `slow`
# tests (memory measurements in fresh processes, the same code on every version) and the Ray
# extra (not installed here); the floor runs the files that decide and take the routes.
set -euo pipefail
cd "$(dirname "$0")/.."

DIRECTML_LAST="1.24.4"
FLOOR="$(sed -n 's/^ *"onnxruntime>=\([0-9.]*\);.*/\1/p' pyproject.toml)"
[ -n "$FLOOR" ] || { echo "ort-versions: no onnxruntime floor found in pyproject.toml" >&2; exit 1; }
FLOOR_TESTS=(tests/test_capabilities.py tests/test_graphs.py tests/test_prepack.py
  tests/test_device.py tests/test_pool.py)

run_on() {  # run_on VERSION PYTEST-ARGS...: a venv with onnxruntime==VERSION, then pytest
  local version="$1" venv=".venv-ort-$1" start status
  shift
  start=$SECONDS
  python3 -m venv --clear "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".[test]" "onnxruntime==$version"
  "$venv/bin/python" -c "import onnxruntime as o; assert o.__version__ == '$version', o.__version__"
  echo "== onnxruntime $version: venv in $((SECONDS - start)) s; pytest $*"
  status=0
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
  echo "== onnxruntime $version: $((SECONDS - start)) s in all, pytest exit $status"
  return "$status"
}

total=$SECONDS
failed=0
run_on "$DIRECTML_LAST" -m "not slow and not ray" || failed=1
if [ "$FLOOR" != "$DIRECTML_LAST" ]; then
  run_on "$FLOOR" -m "not slow" "${FLOOR_TESTS[@]}" || failed=1
fi
echo "== ort-versions.sh: $((SECONDS - total)) s"
exit "$failed"
