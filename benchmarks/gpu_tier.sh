#!/usr/bin/env bash
# The GPU tier (tests/test_gpu.py), on a machine with CUDA whose python3 holds torch (no venv
# there: the repo runs from its checkout, the A* core compiled in place first):
#   bash benchmarks/gpu_tier.sh [LOG_DIR]
# With a GPU per rank the ranks talk NCCL; with fewer GPUs than ranks they share them over gloo.
set -uo pipefail
log=${1:-out/gpu}
mkdir -p "$log"
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count(),
"NCCL", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
python3 setup.py -q build_ext --inplace >"$log/build.log" 2>&1 || { cat "$log/build.log"; exit 1; }
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
python3 -m pytest -v -rs -p no:cacheprovider tests/test_gpu.py tests/test_launch.py 2>&1 | tee "$log/pytest.log"
