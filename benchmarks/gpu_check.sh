#!/usr/bin/env bash
# Everything stagetree claims on a GPU, in one run (issue 26): the CUDA test cases with
# their fused-vs-unfused tolerances printed, then benchmarks/gpu_check.py (fusion
# throughput and widths, exactness with deterministic kernels, a study fused / shared /
# alone, pinned workers), then benchmarks/gpu_fused_kernels.py (HFTA's form against vmap's
# rules). Outputs go to $OUT (else benchmarks/out/gpu_check).
#
#   bash benchmarks/gpu_check.sh              # on a CUDA machine, from the repo root
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu_check.sh   # rehearsal on a CPU
#   SKIP_TESTS=1 bash benchmarks/gpu_check.sh --sections widths   # arguments go to
#                                                              # gpu_check.py
#
# PYTHON names the interpreter (default: .venv/bin/python if present, else python3).
# Where stagetree's dependencies are missing, the wheels in .whl/ are installed to a
# private folder first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/out/gpu_check}
mkdir -p "$out"
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if ! $py -c "import sqlalchemy" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/stagetree-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/stagetree-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Deterministic cuBLAS needs its workspace fixed before CUDA starts (section exactness).
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
device=${DEVICE:-cuda}
if [ "$device" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"; fi

if [ -z "${SKIP_TESTS:-}" ]; then
echo "## CUDA test cases (fused -k cuda with tolerances printed; pinned workers)"
{
  $py -m pytest -p no:cacheprovider -q -s -rs -k cuda tests/pytorch/test_torch_fused.py \
    tests/pytorch/test_torch_grouped.py
  fused=$?
  $py -m pytest -p no:cacheprovider -q -rs tests/executors/test_devices.py
  [ $fused = 0 ] && [ $? = 0 ]
} 2>&1 | tee "$out/pytest.txt"
tests=${PIPESTATUS[0]}
else tests=0; fi

quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
$py benchmarks/gpu_check.py --device "$device" --out "$out" "${quick[@]}" "$@" 2>&1 | tee "$out/gpu_check.txt"
check=${PIPESTATUS[0]}

# HFTA's form for convolutions and BatchNorm: sequential, vmap and grouped side by side
# (short on CUDA: B = 1 and 32; SKIP_KERNELS=1 leaves it out).
kernels=0
if [ -z "${SKIP_KERNELS:-}" ]; then
  short=()
  [ "$device" = cuda ] && short=(--widths 1,32 --steps 3 --repeats 2)
  DEVICE=$device $py benchmarks/gpu_fused_kernels.py "${short[@]}" 2>&1 | tee "$out/gpu_fused_kernels.txt"
  kernels=${PIPESTATUS[0]}
fi
echo "pytest exit $tests, gpu_check exit $check, gpu_fused_kernels exit $kernels"
[ "$tests" = 0 ] && [ "$check" = 0 ] && [ "$kernels" = 0 ]
