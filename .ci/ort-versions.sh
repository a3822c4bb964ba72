#!/usr/bin/env bash
# The suite against the other onnxruntime versions sharedml accepts, each in its own venv (the
# newest is .ci/run's main run): 1.24.4, the last onnxruntime-directml release, which every
# DirectML user runs, and the floor of pyproject.toml on a quick subset. Tests that need a
# capability the version lacks skip with its reason (tests/conftest.py, `capability` marker).
#
# Budget: about 6 of .ci/run's 25 minutes on 2 cores. 1.24.4 runs all but the Ray extra (not
# installed here) and the `slow` tests (memory measured in fresh processes: 6.5 minutes on their
# own), keeping the slow tests of the routes that differ on it; the floor runs the files that
# decide and take the routes. The whole suite passed on both when run by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

DIRECTML_LAST="1.24.4"
FLOOR="$(sed -n 's/^ *"onnxruntime>=\([0-9.]*\);.*/\1/p' pyproject.toml)"
[ -n "$FLOOR" ] || { echo "ort-versions: no onnxruntime floor found in pyproject.toml" >&2; exit 1; }
FLOOR_TESTS=(tests/runtime/test_capabilities.py tests/pool/test_graphs.py tests/weights/test_prepack.py
  tests/weights/test_device.py tests/pool/test_pool.py tests/prepared/test_compress.py)

venv_with() {  # venv_with VERSION: a fresh venv with sharedml[test] and onnxruntime==VERSION
  local version="$1" venv=".venv-ort-$1" start=$SECONDS
  python3 -m venv --clear "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".[test]" "onnxruntime==$version"
  "$venv/bin/python" -c "import onnxruntime as o; from packaging.version import Version as V
assert V(o.__version__) == V('$version'), o.__version__"  # 1.20 is 1.20.0
  echo "== onnxruntime $version: venv in $((SECONDS - start)) s"
}

on() {  # on VERSION PYTEST-ARGS...: pytest in that version's venv; a failure is kept for the end
  local version="$1" start=$SECONDS status=0
  shift
  echo "== onnxruntime $version: pytest $*"
  ".venv-ort-$version/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
  echo "== onnxruntime $version: pytest exit $status in $((SECONDS - start)) s"
  [ "$status" = 0 ] || failed=1
}

total=$SECONDS
failed=0
venv_with "$DIRECTML_LAST"
on "$DIRECTML_LAST" -m "not slow and not ray"
# The memory tests of the routes that differ on it: the saved prepacked model (subgraph
# weights too) and its sharing between a model and its renamed variant.
on "$DIRECTML_LAST" -m slow tests/weights/test_prepack.py \
  "tests/prepared/test_families.py::test_pools_over_a_model_and_its_renamed_variant_share_identical_weights_automatically"
if [ "$FLOOR" != "$DIRECTML_LAST" ]; then
  venv_with "$FLOOR"
  on "$FLOOR" -m "not slow" "${FLOOR_TESTS[@]}"
fi
echo "== ort-versions.sh: $((SECONDS - total)) s in all"
exit "$failed"
