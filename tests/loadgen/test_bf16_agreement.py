"""The bfloat16 agreement tool (loadgen/bf16_agreement.py) on a small random checkpoint with a real
tokenizer and chat template: every side is scored against transformers in float32, position by
position under the reference's text and by free-running greedy outputs."""

from __future__ import annotations

import json

from mqinfer.loadgen import bf16_agreement
from mqinfer.loadgen.checkpoint import make_llama_checkpoint

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def _tokenizer(folder) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["write a short story about a robot who learns to paint", "explain how a hash table works",
              "what is the difference between a list and a tuple in python"] * 10
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))


def test_every_side_is_scored_against_transformers_float32(tmp_path, capsys):
    folder = make_llama_checkpoint(tmp_path / "ck", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    _tokenizer(folder)
    out = tmp_path / "rows.json"
    assert bf16_agreement.main(["--model", str(folder), "--max-tokens", "6", "--num-threads", "1",
                                "--switch", "MQINFER_CPU_ATTENTION=torch", "--json", str(out)]) == 0
    rows = {r["side"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["transformers float32", "transformers bfloat16", "mqinfer bfloat16",
                          "mqinfer bfloat16 with MQINFER_CPU_ATTENTION=torch", "mqinfer float32"]
    # The reference against itself: every position under its own text predicts its next token
    # (so the positions line up), and its greedy outputs are its own.
    reference = rows["transformers float32"]
    assert reference["next_token"] == 1.0 and reference["identical"] == 1.0 and reference["positions"] > 0
    # The engine in float32 is transformers' float32 model token for token.
    assert rows["mqinfer float32"]["next_token"] == 1.0 and rows["mqinfer float32"]["identical"] == 1.0
    for r in rows.values():
        assert r["positions"] == reference["positions"] and 0.0 <= r["next_token"] <= 1.0
    assert "mqinfer bfloat16 with MQINFER_CPU_ATTENTION=torch" in capsys.readouterr().out
