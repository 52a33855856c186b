"""``python -m mqinfer.loadgen.gpu_bench``: the command of before the GPU tools became the subpackage
``mqinfer.loadgen.gpu``, forwarded to ``python -m mqinfer.loadgen.gpu.bench``, whose code and help it
runs (so that the command lines in docs and scripts written before still work)."""

import sys

from mqinfer.loadgen.gpu.bench import main

if __name__ == "__main__":
    sys.exit(main())
