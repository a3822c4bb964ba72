#!/usr/bin/env bash
# The suite against the other onnxruntime versions sharedml accepts, each in its own venv (the
# newest is .ci/run's main run): 1.24.4, the last onnxruntime-directml release, which every
# DirectML user runs, and the floor of pyproject.toml on a quick subset. Tests that need a
# capability the version lacks skip with its reason (tests/conftest.py, `capability` marker).
#
# What runs is what the version can change. 1.24.4 runs every test file but those of
# VERSION_FREE, less the Ray extra (not installed here) and the `slow` tests (memory measured
# in fresh processes), keeping the slow tests of the routes that differ on it; of the
# VERSION_FREE files, only the tests marked with an onnxruntime capability. The floor runs the
# files that decide and take the routes. The whole suite passed on both when run by hand.
#
# Budget: 7.3 min in all, measured with `nice` on the 2-core CI machine while other jobs loaded
# it (load 5-7; a quiet machine takes less). 1.24.4: venv 42 s, the version-dependent files
# 191 s, VERSION_FREE's capability tests 43 s, the slow tests 68 s (every fast test, as before
# VERSION_FREE: 287 s); the floor: venv 40 s, tests 52 s.
set -euo pipefail
cd "$(dirname "$0")/.."

DIRECTML_LAST="1.24.4"
FLOOR="$(sed -n 's/^ *"onnxruntime>=\([0-9.]*\);.*/\1/p' pyproject.toml)"
[ -n "$FLOOR" ] || { echo "ort-versions: no onnxruntime floor found in pyproject.toml" >&2; exit 1; }
FLOOR_TESTS=(tests/runtime/test_capabilities.py tests/pool/test_graphs.py tests/weights/test_prepack.py
  tests/weights/test_device.py tests/pool/test_pool.py tests/prepared/test_compress.py)
# Files whose tests do not depend on the onnxruntime version (the main run has them): the
# package's layout, public names, packaging, docs and fixtures; the row analysis (graph facts,
# ORT only the oracle of standard ops) and the scheduler (fake sessions); inspect's findings
# and report (made-up figures; its measurements are `slow`); the cache's files, stamps and CLI;
# the benchmarks' scripts; the Ray extra's HTTP codecs and nodes (no Ray here). A file that
# builds sessions through the routes, loads prepared or compressed files, or maps onnxruntime's
# errors is version-dependent and stays out of this list.
VERSION_FREE=(tests/test_layout.py tests/test_public_api.py tests/test_packaging.py
  tests/test_docs.py tests/test_fixtures.py tests/test_host.py tests/test_benchmarks.py
  tests/pool/test_rows.py tests/pool/test_scheduler.py tests/inspection/test_findings.py
  tests/inspection/test_inspect.py tests/cache tests/sharedml_ray)

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
on "$DIRECTML_LAST" -m "not slow and not ray" tests "${VERSION_FREE[@]/#/--ignore=}"
on "$DIRECTML_LAST" -m "capability and not slow and not ray" "${VERSION_FREE[@]}"
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
