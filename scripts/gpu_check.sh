#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI does not have: the CUDA tests of the Top-K selection and of
# the packed message (CUDA's bytes are the CPU's), and bench select on the GPU (ours against torch.topk,
# side by side in one run).
#
# Needs python3 with a CUDA build of torch, pytest and hypothesis (Horovod is not needed: the
# selection and the message, hvd_topk.core.sparsify and .codec, import none). From the repository root:
#   bash scripts/gpu_check.sh RESULTS_DIR
# On a copy of the tree, set HVD_TOPK_COMMIT to the commit the copy was made from (its .git may be
# missing or stale).
set -euo pipefail
out=${1:?usage: bash scripts/gpu_check.sh RESULTS_DIR}
mkdir -p "$out"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(0))'
# -rs lists any skip: on a GPU machine none of these may skip.
python3 -m pytest tests/test_sparsify.py tests/test_codec.py -k cuda -q -rs 2>&1 | tee "$out/pytest_cuda.txt"
! grep -q "skipped" "$out/pytest_cuda.txt"
python3 -m bench select --device cuda --dtypes fp32,fp16,bf16 --sizes 1M,10M,25M,50M,100M,200M --repeats 7 --out "$out/select_cuda" 2>&1 | tee "$out/select_cuda.txt"
