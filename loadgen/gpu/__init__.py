"""The GPU tools: what a session on a GPU machine runs to check and measure mqinfer there.

``check`` (``python -m mqinfer.loadgen.gpu.check``) runs every CUDA path against its reference, its
cases in ``check_cases``; ``kernels`` times the Triton kernels against the PyTorch path;
``tensor_parallel`` checks tensor parallelism over NCCL; ``bench`` (``python -m
mqinfer.loadgen.gpu.bench``, with ``bench_phases``, ``bench_run`` and ``bench_roofs``) measures the
worker against transformers and the memory roof; ``session.sh`` is a whole GPU session in one
script. The commands of before this subpackage (``python -m mqinfer.loadgen.gpu_check``,
``gpu_bench``, ``gpu_kernels``, ``gpu_tensor_parallel``, and ``loadgen/gpu_session.sh``) forward
here. docs/gpu.md says what has run on a GPU.
"""
