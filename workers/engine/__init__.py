"""The worker's engine side: requests in, one step at a time, tokens and billable work out.

The engine (``core``: ``LLMEngine`` and its step; ``startup``, ``inputs``, ``outputs``), the model
runner (``model_runner``, ``decode_graphs``, ``swap``), the model families (``models/``) and
loading them (``loader``, ``gguf``, ``prepared``), tokenizers (``tokenizer``, ``gguf_tokenizer``),
KV tiers below the device cache (``kv_tiers``, ``kv_store``, ``kv_codec``), structured output and
sampling controls (``structured``, ``grammar_check``, ``logits_processors``), speculative
proposers (``ngram_proposer``, ``self_proposer``, ``draft_proposer``) and tensor and pipeline
parallel ranks (``parallel``, ``pipeline``, ``ranks``, ``tp_rank``). It knows nothing of streams:
the queue side (``mqinfer.workers.queue``) drives it.
"""
