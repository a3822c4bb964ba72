#!/usr/bin/env bash
# ONNX Runtime's WebGPU plugin execution provider on Linux without a GPU: Mesa's software
# Vulkan driver (lavapipe) from Debian, then a virtual environment with sharedml (this checkout,
# editable), pytest and onnxruntime-ep-webgpu. docs/webgpu.md says what it proves and what not.
#
#   tools/webgpu/setup.sh [VENV]      default VENV: .venv-webgpu (in the checkout)
#   then: export ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1; VENV/bin/python -m pytest -m webgpu
#
# Debian 12's own Mesa 22.3 lavapipe offers WebGPU no adapter: Mesa 25 comes from
# bookworm-backports. Idempotent: packages already there are not installed again; the venv is
# reused while it has the pinned plugin. About a minute fresh, seconds when set up.
#
# Environment:
#   PYTHON              the Python that makes the venv (default: python3)
#   WEBGPU_EP_VERSION   onnxruntime-ep-webgpu's version (default: 0.4.0, which needs onnxruntime
#                       >= 1.24.4; pip resolves onnxruntime within sharedml's own range)
#
# Exit status: 0 ready (a WebGPU session ran on the CPU EP's numbers); 3 this machine cannot
# install it (not Debian 12, not root for the missing packages, no network): nothing was wrong;
# 1 anything else (no adapter after all, a session that fails or falls back): a real failure.
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV=${1:-.venv-webgpu}
PY=${PYTHON:-python3}
EP_VERSION=${WEBGPU_EP_VERSION:-0.4.0}
T0=$(date +%s)
step() { echo "[webgpu $(($(date +%s) - T0))s] $*"; }
unavailable() { echo "[webgpu] UNAVAILABLE on this machine: $*" >&2; exit 3; }
fail() { echo "[webgpu] FAILED: $*" >&2; exit 1; }

installed_version() { dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null | sed -n 's/^install ok installed //p'; }

packages_ready() {
  [ -n "$(installed_version libvulkan1)" ] && [ -n "$(installed_version mesa-vulkan-drivers)" ] &&
    dpkg --compare-versions "$(installed_version mesa-vulkan-drivers)" ge 25
}

install_packages() {
  command -v apt-get >/dev/null && command -v dpkg-query >/dev/null ||
    unavailable "no apt-get: this setup needs Debian 12 (bookworm) packages"
  grep -qs 'VERSION_CODENAME=bookworm' /etc/os-release ||
    unavailable "not Debian 12 (bookworm): Mesa 25's lavapipe comes from bookworm-backports"
  [ "$(id -u)" = 0 ] ||
    unavailable "packages missing and not root: install libvulkan1 and, from bookworm-backports, mesa-vulkan-drivers (>= 25)"
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    local mirror
    mirror=$( (grep -hoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true) | head -1 | tr -d ' ')
    [ -n "$mirror" ] || unavailable "no Debian mirror in /etc/apt to take bookworm-backports from"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" >/etc/apt/sources.list.d/bookworm-backports.sources
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || unavailable "apt-get update failed (no network to the Debian mirror?)"
  apt-get install -y -qq --no-install-recommends libvulkan1 vulkan-tools >/dev/null ||
    unavailable "apt-get install libvulkan1 vulkan-tools failed"
  apt-get install -y -qq --no-install-recommends -t bookworm-backports mesa-vulkan-drivers >/dev/null ||
    unavailable "apt-get install -t bookworm-backports mesa-vulkan-drivers failed"
  packages_ready || fail "packages installed but not Mesa >= 25"
}

if packages_ready; then
  step "Vulkan loader and Mesa $(installed_version mesa-vulkan-drivers) already installed"
else
  step "installing the Vulkan loader and Mesa 25 (bookworm-backports)"
  install_packages
fi

if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('onnxruntime-ep-webgpu') != '$EP_VERSION')" 2>/dev/null; then
  step "virtual environment $VENV: sharedml (editable), pytest, onnxruntime-ep-webgpu==$EP_VERSION"
  "$PY" -m venv --clear "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e . pytest psutil \
    "onnxruntime-ep-webgpu==$EP_VERSION" || unavailable "pip install failed (no network to PyPI?)"
fi

# The smoke test: a WebGPU session on the software adapter, its outputs equal to the CPU EP's.
export ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1
"$VENV/bin/python" - <<'PY' || fail "no working WebGPU session (see above)"
import numpy as np, onnxruntime as ort, onnxruntime_ep_webgpu as ep
from onnx import TensorProto, helper, numpy_helper
w = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "smoke",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
                      [numpy_helper.from_array(w, "w")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 8
ort.register_execution_provider_library(ep.get_ep_name(), ep.get_library_path())
devices = [d for d in ort.get_ep_devices() if d.ep_name == ep.get_ep_name()]
assert devices, "the WebGPU plugin offers no device: is Mesa's lavapipe (>= 25) installed?"
so = ort.SessionOptions(); so.add_provider_for_devices(devices[:1], {})
s = ort.InferenceSession(m.SerializeToString(), so)
assert s.get_providers()[0] == ep.get_ep_name(), s.get_providers()
x = np.ones((2, 8), np.float32)
assert np.allclose(s.run(None, {"x": x})[0], x @ w, atol=1e-5)
print(f"[webgpu] ready: onnxruntime {ort.__version__}, onnxruntime-ep-webgpu on",
      devices[0].device.vendor, str(devices[0].device.type).rsplit(".", 1)[-1])
PY
step "done"
