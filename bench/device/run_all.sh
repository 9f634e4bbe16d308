#!/usr/bin/env bash
# One device call's worth of GPU work, results under $OUT (bench/device/README.md):
#   source bench/device/h200_setup.sh && CVLLM_BENCH_COMMIT=<short hash> bash bench/device/run_all.sh bench
# "tests": the gpu-marked tests, file by file (up to ~9 min); "bench": latency, throughput and serving (~6 min).
# Each runs under a timeout so that one stuck step cannot eat the call; a short table per step is printed last.
set -uo pipefail
what=${1:-bench}
commit=${CVLLM_BENCH_COMMIT:?set CVLLM_BENCH_COMMIT to the commit being measured (the device copy of .git is stale)}
day=$(date +%F)
out=${OUT:?run on the device machine, where OUT is set}
run() {   # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "--- $name: exit $?"
    tail -n 14 "$out/$name.log"
}
case $what in
tests)
    # a file at a time, the end-to-end checks first, each under its own limit: a slow file cannot starve the rest
    # (all together they have taken 6-9 minutes; the compiles of each new shape are most of it)
    t=plugins/backend-cuda/tests
    run gpu-tests-engine 240 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_cuda_engine_gpu.py \
        plugins/models-qwen/tests/test_qwen_gguf.py --durations=3
    run gpu-tests-argmax 60 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_argmax.py --durations=3
    run gpu-tests-matmul 100 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_matmul.py --durations=3
    run gpu-tests-fused 60 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_fused_kernels_gpu.py --durations=3
    run gpu-tests-kernels 240 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_kernels_gpu.py --durations=3 ;;
bench)
    run latency 150 python3 bench/latency.py --json "$out/$day-h200-latency-$commit.json"
    run throughput 150 python3 bench/throughput.py --json "$out/$day-h200-throughput-$commit.json"
    run serving 260 python3 bench/serving.py --json "$out/$day-h200-serving-$commit.json" ;;
*)
    echo "usage: run_all.sh tests|bench" >&2
    exit 2 ;;
esac
