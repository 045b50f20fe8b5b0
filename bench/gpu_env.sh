# Sourced by the bench/gpu_*.sh scripts on the GPU machine: the carried wheels (.whl/) installed
# beside the image's own packages, the repository on the path, and what the machine is in $OUT.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# build/routing_whl/ (the router's wheels, llguidance among them, which the engine imports too) where carried,
# but not its tokenizers where the image has one: the image's transformers needs its own version.
routing=$(ls build/routing_whl/*.whl 2>/dev/null)
if python3 -c "import tokenizers" 2>/dev/null; then routing=$(echo "$routing" | grep -v "/tokenizers-"); fi
# build/hf_whl/ (transformers 5.23, the HF-parity tests' reference, with the hub, safetensors and regex it needs)
# where carried: the image's 5.17 predates the newest families.
hf=$(ls build/hf_whl/*.whl 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $routing $hf || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
