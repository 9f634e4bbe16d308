#!/usr/bin/env bash
# Source at the start of a device command on the GPU machine (see bench/device/README.md):
# installs the carried wheels and the project's packages offline into /tmp/site.
# (sourced: no `set -e`, which would end the caller's shell at its first failing command)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
# --upgrade: a machine still warm from an earlier call has the previous commit's packages there (pip keeps an
# existing target directory otherwise, and the new code would not run)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site \
    ./core ./plugins/models-llama ./plugins/models-qwen ./plugins/models-deepseek ./plugins/models-phi ./plugins/models-gemma ./plugins/models-glm \
    ./plugins/models-stablelm ./plugins/quant-gguf ./plugins/quant-marlin ./plugins/quant-fp8 \
    ./plugins/backend-cuda || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
