#!/usr/bin/env bash
# The whole -m gpu suite in one device call: run_all.sh tests as four parallel streams of step names, a watchdog
# (SUITE_LIMIT_S, default 500 s) so that the summary prints inside the call, then per step the tests run (pytest's
# progress characters: its summary line does not reach these logs), the failures, and the failing tests' headers.
#   carry the snapshot as .snap (bench/device/README.md); in the call: COMMIT=<hash> bash .snap/bench/device/suite_parallel.sh
#   (or the working tree: COMMIT=<hash> bash bench/device/suite_parallel.sh; STREAMS= picks groups, below)
cd "$(dirname "$0")/../.." && source bench/device/h200_setup.sh || exit 1
export CVLLM_BENCH_COMMIT=$COMMIT
mkdir -p /tmp/logs
# (kquants alone: its CPU references take ~4-6 minutes, which cut it short behind three other groups; families and
# deepseek in a fifth stream since each engine captures its prefill-chunk graphs too: at 380 s the watchdog cut them;
# quant alone since 2026-12-05: with moe after it, 240 s were not enough for its 122 tests; in three streams since
# 2026-12-06: alone it stopped at its 420 s limit after ~166 of 195 tests)
streams=("gpu-tests-engine gpu-tests-spec-embed gpu-tests-argmax gpu-tests-matmul gpu-tests-kv-fp8"
         "gpu-tests-fused gpu-tests-kernels"
         "gpu-tests-quant"
         "gpu-tests-quant-gemv"
         "gpu-tests-quant-plugins"
         "gpu-tests-moe"
         "gpu-tests-kquants"
         "gpu-tests-families gpu-tests-deepseek")
# STREAMS="a b;c;d e" runs those groups instead (streams separated by ';'): part of the suite in one call
if [ -n "${STREAMS:-}" ]; then IFS=';' read -r -a streams <<< "$STREAMS"; fi
i=0
for s in "${streams[@]}"; do
  mkdir -p /tmp/logs/$i
  OUT=/tmp/logs/$i ONLY="$s" bash bench/device/run_all.sh tests > /tmp/logs/stream$i.txt 2>&1 &
  i=$((i+1))
done
( sleep ${SUITE_LIMIT_S:-500}; pkill -f 'run_all.sh tests'; pkill -f pytest ) &
watchdog=$!
wait $(jobs -p | grep -v "^$watchdog$")
kill $watchdog 2>/dev/null
for f in /tmp/logs/*/*.log; do
  n=$(basename $f .log)
  dots=$(grep -E '^[.sFExX]+( +\[ *[0-9]+%\])?$' $f | tr -d ' []%0-9\n' | wc -c)
  fails=$(grep -E '^[.sFExX]+( +\[ *[0-9]+%\])?$' $f | tr -cd 'FE' | wc -c)
  echo "$n: progress chars $dots, F/E $fails; $(grep -E 'passed|failed|error' $f | tail -1)"
  grep -E '^(FAILED|ERROR)|^_{3,} .+ _{3,}$' $f | head -6
done
grep -h -- "--- gpu" /tmp/logs/stream*.txt
