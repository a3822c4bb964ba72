#!/usr/bin/env bash
# CI: the tests of files, caches and permissions, run as an ordinary user.
#
# Root bypasses file modes, so a suite run as root never sees a permission bug (sharedml's dedupe
# step once rewrote a read-only file: every user but root failed). Run as root, this script makes
# an ordinary user if there is none, gives it a writable copy of the checkout, its own HOME (so
# its own default cache) and a virtual environment it can run, and runs the cache, prepare,
# family, dedupe, security, pool and fixture tests as that user. Tests that need a second user
# create one themselves when the suite runs as root (they skip, saying so, here). Run as an
# ordinary user, it runs the same tests directly. Not those that file modes cannot change and
# that take long (SELECT): the main run has them.
#
# Budget: 1.5 min, measured with `nice` on the 2-core CI machine while other jobs loaded it
# (load 4-5; a quiet machine takes less): setup (copy, venv, install) 29 s, tests 61 s. Before
# SELECT the tests took 108 s without the slow ones (load 6), and the slow ones 192 s more in
# the main run.
#
# Usage: .ci/unprivileged.sh            (from .ci/run, after the main test run)
# Environment: SHAREDML_CI_USER  the user to run as (default: sharedml-ci, created if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

TESTS=(
    tests/cache/test_cache.py
    tests/cache/test_cache_stamps.py
    tests/cache/test_cache_cli.py
    tests/prepared/test_prepare.py
    tests/prepared/test_families.py
    tests/prepared/test_dedupe.py
    tests/prepared/test_static.py
    tests/prepared/test_outputs.py
    tests/test_security.py
    tests/pool/test_pool.py
    tests/test_fixtures.py
)
# What file modes cannot change, and costs time, stays with the main run: the `slow` tests
# (memory measured in fresh processes), and these, which measure a weights file's size,
# inspect's figures, or what a fork does.
SELECT=(-m "not slow"
    --deselect tests/prepared/test_prepare.py::test_many_tiny_tensors_do_not_each_cost_a_page
    --deselect tests/prepared/test_families.py::test_family_inspect_takes_dims_shapes_and_inputs_for_every_member
    --deselect tests/prepared/test_families.py::test_inspect_reports_a_familys_distinct_and_total_weights_and_its_memory
    --deselect tests/pool/test_pool.py::test_a_pool_used_after_fork_raises_instead_of_hanging)

if [ "$(id -u)" -ne 0 ]; then
    echo "unprivileged tests: already running as $(id -un)"
    python -m pytest -q "${SELECT[@]}" "${TESTS[@]}"
    echo "unprivileged tests: $((SECONDS - start)) s"
    exit 0
fi

user=${SHAREDML_CI_USER:-sharedml-ci}
created=0
if ! id -u "$user" >/dev/null 2>&1; then
    useradd --no-create-home --shell /usr/sbin/nologin "$user"
    created=1
fi
as_user() {
    if command -v runuser >/dev/null; then
        runuser -u "$user" -- "$@"
    else
        setpriv --reuid="$user" --regid="$(id -g "$user")" --clear-groups -- "$@"
    fi
}

work=$(mktemp -d /tmp/sharedml-unprivileged.XXXXXX)
cleanup() {
    rm -rf "$work"
    if [ "$created" = 1 ]; then userdel "$user" 2>/dev/null || true; fi
}
trap cleanup EXIT
chmod 755 "$work"

# A copy the user can write (pytest's and hypothesis's caches, model generators' outputs).
mkdir "$work/repo" "$work/home"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/repo"
else
    tar --exclude=./.venv -cf - . | tar -xf - -C "$work/repo"
fi

# An interpreter the user can run: this one's base, unless it sits where the user cannot read
# (pyenv under /root), then the system's.
python=""
for candidate in "$(python3 -c 'import sys, os; print(os.path.realpath(sys._base_executable))')" \
    /usr/bin/python3; do
    if [ -x "$candidate" ] && as_user "$candidate" -c 'import venv, ensurepip' 2>/dev/null; then
        python=$candidate
        break
    fi
done
if [ -z "$python" ]; then
    echo "unprivileged tests: no Python that user $user can run (install python3-venv)" >&2
    exit 1
fi
# Installed by root, whose pip cache is warm; then handed to the user.
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -qq --upgrade pip
"$work/venv/bin/python" -m pip install -qq -e "$work/repo[test]"
chown -R "$user:" "$work/repo" "$work/home" "$work/venv"
echo "unprivileged tests: as $user ($(id -u "$user")), HOME=$work/home, $("$python" -V)," \
    "setup $((SECONDS - start)) s"

cd "$work/repo"
# pytest's temporary folders under this run's own home: /tmp/pytest-of-USER may be left by an
# earlier user of that name with another uid (a CI user deleted and made again), which pytest
# refuses to use. The tests' other temporary files in a folder of the run too, which they must
# leave empty: what a test forgets there fails the job (and goes with $work).
mkdir "$work/tmp"
chown "$user:" "$work/tmp"
status=0
as_user env -i HOME="$work/home" TMPDIR="$work/tmp" PATH="$work/venv/bin:/usr/bin:/bin" \
    LANG=C.UTF-8 "$work/venv/bin/python" -m pytest -q "${SELECT[@]}" --basetemp "$work/home/pytest" \
    "${TESTS[@]}" || status=$?
# .ses: onnxruntime's telemetry SDK keeps its first-launch time there, once per folder.
left=$(find "$work/tmp" -mindepth 1 -maxdepth 1 ! -name .ses)
if [ -n "$left" ]; then
    echo "unprivileged tests: left in the temporary folder:" >&2
    echo "$left" >&2
    [ "$status" -ne 0 ] || status=1
fi
echo "unprivileged tests: $((SECONDS - start)) s"
exit "$status"
