"""Model families: the architectures mqinfer can run, keyed by their Hugging Face class name.

Every family here runs the packed flat batch over the paged KV cache (see ``llama.py``); the
per-family differences (biases, q/k norms, tied embeddings, head_dim) are flags on
``ModelConfig`` read from the checkpoint's config.json.
"""

from mqinfer.workers.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from mqinfer.workers.engine.models.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelConfig"]
