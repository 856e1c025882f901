#!/usr/bin/env bash
# The torch engine's CUDA paths on a machine with a GPU (never run by CI, which
# has none). Run from the repository root on that machine; everything it
# prints also goes to $OUT/log (or ./gpu-check.log without $OUT).
#
#   (a) the torch tests with their CUDA cases (`-k cuda`: the `device=cuda`
#       parametrisations, marked `cuda`: deselected where there is no GPU);
#   (b, c) .ci/gpu_check.py: a SmolLM2-135M-shaped GGUF over two stages on the
#       GPU against the same on the CPU in float32, two `meshnet-node --device
#       cuda` processes answering one session, `meshnet run --device cuda`
#       answering one `meshnet generate`.
#
# Packages the machine lacks travel as wheels in .whl/ (installed to
# /tmp/site, no network needed); nothing else is installed. The project runs
# from src/ (PYTHONPATH), as pytest's own configuration runs it.
# Exit status: the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-.}/log"
[ -n "${OUT:-}" ] || LOG=gpu-check.log
exec > >(tee "$LOG") 2>&1

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'

failed=0
echo "== (a) torch tests, CUDA cases"
start=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs -k cuda --durations=8 \
    -n "${GPU_CHECK_WORKERS:-4}" \
    tests/model/test_torch_engine.py tests/model/test_torch_reference.py \
    tests/model/test_torch_limits.py tests/node/test_torch_node.py || failed=$((failed + 1))
echo "(a) took $((SECONDS - start)) s"

echo "== (b, c) gpu_check.py"
start=$SECONDS
timeout 220 python3 .ci/gpu_check.py --device "${GPU_CHECK_DEVICE:-cuda}" "$@" \
    || failed=$((failed + 1))
echo "(b, c) took $((SECONDS - start)) s"

echo "gpu-check: $failed step(s) failed"
exit "$failed"
