#!/usr/bin/env bash
# The GPU figures of README and docs/gpu.md, on a lent NVIDIA H200 (see benchmarks/README.md).
#
# onnxruntime-gpu (255 MB) travels in parts: ../shared/device/split-wheel.sh writes .ortgpu1..5
# here; five calls copy one part each into /tmp/ortgpu-parts; then, while the machine is warm,
# a call that also carries .whl/ (pip download --no-deps -d .whl platformdirs filelock):
#   bash benchmarks/gpu_run.sh tests     # wheel assembled; the GPU tests (~1 min)
#   bash benchmarks/gpu_run.sh levers    # ORT's arena levers on 8 pooled BERT sessions (~1 min)
#   bash benchmarks/gpu_run.sh bert      # serving figures, BERT-base-like (~5 min)
#   bash benchmarks/gpu_run.sh resnet    # serving figures, ResNet-50-like (~4 min)
#   bash benchmarks/gpu_run.sh ceiling   # one BERT-like session, batches of 1..32 back to back,
#                                        # without and with CUDA graphs (~2 min)
#   bash benchmarks/gpu_run.sh turnaround  # 16 async callers against that ceiling: asyncio and
#                                        # uvloop, busy vCPUs, a pinned loop (~3 min)
# Results go to $OUT (the device tool brings them back) and benchmarks/results/ by hand.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT"
if [ ! -d /tmp/site/onnxruntime ]; then
  d=/tmp/ortgpu-parts
  [ -f "$d/WHEEL_NAME" ] || { echo "no wheel parts in $d: the machine went back; upload them again"; exit 3; }
  name="$(cat "$d/WHEEL_NAME")"
  cat "$d"/part.? > "/tmp/$name"
  [ "$(sha256sum "/tmp/$name" | cut -d' ' -f1)" = "$(cat "$d/SHA256")" ] || { echo "a wheel part is missing"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "/tmp/$name"
fi
# Packages sharedml needs that the image lacks (platformdirs; filelock >= 3.20.1), carried as
# wheels in .whl/ (the device tool's README says how), go beside the GPU build.
if [ -d .whl ] && [ ! -d /tmp/site/platformdirs ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
export PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())
assert 'CUDAExecutionProvider' in o.get_available_providers(), 'not the GPU build'" || exit 3
# The image's CPU onnxruntime stays installed; /tmp/site comes first on sys.path, in a folder of
# its own, so that the GPU build is the one imported (and sharedml does not warn of a mixed one).
CONFIGS="plain:8 single pool:8 pool:1:batch pool:2:batch pool:4:batch pool:1:batch:views pool:2:batch:views pool:4:batch:views pool:2:batch:views:buckets pool:8:graph pool:2:batch:graph:views plain:8:serialized pool:1:batch:serialized"
case "${1:-}" in
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/weights/test_device.py tests/prepared/test_families.py tests/prepared/test_dedupe.py -s 2>&1 \
      | grep -v "No registered plugin EP" | tee "$OUT/gpu-tests.log" | tail -40
    ;;
  levers)
    timeout 240 python3 benchmarks/gpu_levers.py --model bert --sessions 8 \
      --duration-s 2 --json "$OUT/gpu-levers-bert.json" 2>&1 | tail -8
    ;;
  ceiling)
    export SHAREDML_DEVICE_ROUTE=ort-slab
    timeout 240 python3 benchmarks/serving.py --providers CUDAExecutionProvider --models bert \
      --seq 128 --ceiling --ceiling-configs plain pool graph graph-replay --duration-s 1 \
      --json "$OUT/gpu-ceiling-{model}.json" 2>&1 | tail -26
    ;;
  bert|resnet)
    export SHAREDML_DEVICE_ROUTE=ort-slab  # probed by the tests run: children need not again
    configs="$CONFIGS"
    [ "$1" = resnet ] && configs="plain:8 single pool:8 pool:1:batch pool:1:batch:nopad pool:2:batch pool:2:batch:views pool:4:batch:views pool:8:graph pool:2:batch:graph:views plain:8:serialized pool:1:batch:serialized"
    configs="${2:-$configs}"  # a second argument: these configs instead
    timeout 420 python3 benchmarks/serving.py --providers CUDAExecutionProvider \
      --models "$1" --seq 128 --callers 16 64 --configs $configs --duration-s 1.5 --warmup-s 0.5 \
      --json "$OUT/gpu-serving-{model}.json" 2>&1 | grep -v "^$" | tail -30
    [ -n "${2:-}" ] && [ "${LATENCY:-1}" = 0 ] && exit 0
    timeout 100 python3 benchmarks/serving.py --providers CUDAExecutionProvider \
      --models "$1" --seq 128 --callers 1 8 --configs ${LATENCY_CONFIGS:-pool:1 pool:1:graph pool:8 pool:8:graph} \
      --duration-s 1.5 --warmup-s 0.5 --json "$OUT/gpu-latency-{model}.json" 2>&1 | tail -8
    ;;
  turnaround)
    # 16 callers on one event loop against one session's 16-row ceiling (docs/gpu.md), on
    # asyncio's loop and uvloop's, with idle vCPUs kept busy by low-priority loops (a
    # demonstration of the host's share), and the callers' loop pinned to one CPU (~3 min).
    export SHAREDML_DEVICE_ROUTE=ort-slab
    t="python3 benchmarks/turnaround.py --model bert --providers CUDAExecutionProvider --sessions 1 --asyncio --out-dir /tmp/turnaround"
    one() { label=$1; shift; echo "== $label"; timeout 150 "$@" --json "$OUT/turnaround-$label.json" 2>&1 | grep '^{'; }
    one asyncio $t --views
    one asyncio-copies $t
    one uvloop $t --views --uvloop
    for _ in $(seq "$(( $(nproc) - 2 ))"); do nice -n 19 python3 -c "while True: pass" & done
    sleep 0.5
    one asyncio-busy $t --views
    one uvloop-busy $t --views --uvloop
    kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
    one asyncio-pin1 $t --views --pin 1
    one asyncio-again $t --views
    one uvloop-again $t --views --uvloop
    ;;
  *) echo "usage: $0 tests|levers|ceiling|bert|resnet|turnaround"; exit 2 ;;
esac
