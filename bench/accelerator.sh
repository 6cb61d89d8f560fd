#!/usr/bin/env bash
# The speed checks of the fused and compiled modes on a machine with an accelerator, in one run.
#
# Meant for the project's lent GPU machine (torch and a CUDA jaxlib preinstalled, no network): it
# installs this checkout without dependencies (entry points and, when a compiler is there, the
# native hooks), runs a fixed slice of the tests on the accelerator, then the step benchmarks, and
# prints their tables last. Results also go to $OUT (or build/accelerator).
# Run: bash bench/accelerator.sh        (PY=... to choose the interpreter, PLATFORM=cpu to try it here)
set -uo pipefail
PY="${PY:-python}"
# The checkout stays importable from source if the editable install cannot build there.
export TORCH_PJRT_PLATFORM="${PLATFORM:-cuda}" PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
results="${OUT:-build/accelerator}"
mkdir -p "$results"

"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -2
"$PY" -c "import torch, jax, torch_pjrt; print('torch', torch.__version__, 'jax', jax.__version__, jax.devices())" \
    | tee "$results/versions.txt"
"$PY" -m pytest -q -x -p no:cacheprovider tests/test_device.py tests/test_fused.py tests/test_compile.py \
    tests/test_training.py tests/test_device_checks.py tests/test_kernels.py 2>&1 | tail -3 | tee "$results/tests.txt"
"$PY" bench/dispatch_overhead.py > "$results/dispatch.txt" 2>&1
"$PY" bench/train_step.py --steps 20 --skip-inductor > "$results/train_step.txt" 2>&1
"$PY" bench/step_breakdown.py --steps 20 > "$results/breakdown.txt" 2>&1
"$PY" bench/first_step.py > "$results/first_step.txt" 2>&1
"$PY" bench/device_checks.py > "$results/device_checks.txt" 2>&1
"$PY" bench/flash_attention.py > "$results/flash_attention.txt" 2>&1
"$PY" bench/paged_attention.py > "$results/paged_attention.txt" 2>&1
# Collectives on the single-GPU machine: world size 1, the XLA engine's one-device mesh (per-call latency;
# multi-GPU NCCL needs a machine with several GPUs). vLLM (bench/serving.py) is not installed there.
"$PY" -m torch.distributed.run --nproc-per-node 1 bench/allreduce.py --rounds 2 --steps 8 > "$results/allreduce.txt" 2>&1
for table in dispatch train_step breakdown first_step device_checks flash_attention paged_attention allreduce; do
    echo "== $table"
    grep -v "^W[0-9]" "$results/$table.txt" | tail -14
done
