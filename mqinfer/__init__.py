"""mqinfer: message-queue batch inference for large language models.

The subpackages' code lives in the repository's top-level folders (workers/, scheduler/, kernels/,
schemas/, ops/, loadgen/); this folder holds a relative symlink to each, so ``mqinfer.workers`` is
``mqinfer/workers/`` -> ``workers/`` by the plain rules of the import system, in a checkout and in an
install alike. README.md ("Where the code lives") says why.
"""

__version__ = "0.1.0"
