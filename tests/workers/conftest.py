"""Fixtures of the worker and engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_torch_thread():
    """Run the model on one thread: tests share a small machine, where more threads only contend."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Shape of the tiny random checkpoints: small enough that transformers' generate takes
# milliseconds per token, with grouped-query attention (4 heads over 2 KV heads).
TINY_HF_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.1,
                      bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def make_hf_checkpoint():
    """A function that saves a tiny random float32 checkpoint of one family with transformers.

    ``make(family, folder, seed, **config)`` with family one of llama, mistral, qwen2, qwen3
    returns the transformers model it saved (``hf_greedy`` runs it without EOS). Norm weights (q/k norms included) and
    projection biases are drawn at random rather than left at HF's ones and zeros, so a missing
    or misplaced norm or bias changes the outputs.
    """
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }

    def make(family: str, folder, seed: int = 0, **config):
        config_cls, model_cls = classes[family]
        torch.manual_seed(seed)
        model = model_cls(config_cls(**{**TINY_HF_CONFIG, **config})).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith("proj.bias"):
                    p.normal_(0, 0.5)
        model.save_pretrained(folder)
        return model

    return make


def _hf_greedy_steps(model, prompt: list[int], n: int):
    """transformers' greedy continuation of ``prompt``: n token ids, and per step the
    log-probabilities of the whole vocabulary, from ``generate(do_sample=False)`` on one thread.

    EOS is switched off for the call, so it runs the full length as requests with ``ignore_eos``
    do, and no EOS logit is masked; the model's generation config is put back afterwards.
    """
    import torch

    config = model.generation_config
    saved = (config.eos_token_id, config.pad_token_id)
    config.eos_token_id, config.pad_token_id = None, 0
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 output_logits=True, return_dict_in_generate=True)
    finally:
        torch.set_num_threads(before)
        config.eos_token_id, config.pad_token_id = saved
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


@pytest.fixture(scope="session")
def hf_greedy():
    """A function giving transformers' greedy continuation of a prompt and each token's logprob.

    ``greedy(model, prompt, n)`` -> (n token ids, their n log-probabilities).
    """

    def greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        tokens, steps = _hf_greedy_steps(model, prompt, n)
        return tokens, [float(step[t]) for step, t in zip(steps, tokens)]

    return greedy


@pytest.fixture(scope="session")
def hf_greedy_steps():
    """A function giving transformers' greedy continuation of a prompt with every step's
    distribution: ``steps(model, prompt, n)`` -> (n token ids, n log-softmax tensors over the
    vocabulary), for checking top-k logprobs as well as the chosen tokens'."""
    return _hf_greedy_steps
