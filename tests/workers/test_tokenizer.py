"""Tokenizers, chat templates and incremental detokenization with stop strings."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.workers.engine.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    load_tokenizer,
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokenizer; héllo wörld",
    "message queues batch inference for language models",
    "naïve café — 東京 €5 😀",
] * 20


def _build_hf_folder(folder, post_processor_bos=True, **config):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if post_processor_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
           "chat_template": CHAT_TEMPLATE, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    return load_tokenizer(_build_hf_folder(tmp_path_factory.mktemp("tok")))


def _feed_one_by_one(detok, ids):
    deltas = [detok.feed([i]) for i in ids]
    return deltas, detok.flush()


# ---------------------------------------------------------------------------- ByteTokenizer
def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo, wörld € 𝄞"
    ids = tok.encode(text)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([256, 104, 105, 257, 258, 263]) == "hi"  # specials skipped
    assert tok.decode([0xFF, 104]) == "\ufffdh"  # invalid UTF-8 replaced


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert tok.encode_chat(messages) == [256, *text.encode()]
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        tok.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])


# ---------------------------------------------------------------------------- HFTokenizer
def test_hf_tokenizer_bos_and_round_trip(hf_tok):
    bos = hf_tok.bos_token_id
    assert bos == 0 and hf_tok.eos_token_id == 1
    text = "hello world, naïve café 東京 😀"
    ids = hf_tok.encode(text)
    assert ids[0] == bos and ids.count(bos) == 1
    assert hf_tok.encode(text, add_special_tokens=False) == ids[1:]
    assert hf_tok.decode(ids) == text  # byte-level BPE is lossless; BOS is skipped
    assert len(ids) < len(text.encode())  # merges were learned


def test_hf_tokenizer_config_overrides_bos(tmp_path):
    no_bos = load_tokenizer(_build_hf_folder(tmp_path / "a", add_bos_token=False))
    assert no_bos.encode("hello")[0] != no_bos.bos_token_id
    add_bos = load_tokenizer(_build_hf_folder(tmp_path / "b", post_processor_bos=False, add_bos_token=True,
                                              add_eos_token=True))
    ids = add_bos.encode("hello")
    assert ids[0] == add_bos.bos_token_id and ids[-1] == add_bos.eos_token_id


def test_hf_chat_template(hf_tok, tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    text = hf_tok.apply_chat_template(messages)
    assert text == "<s>[system] be brief</s>\n[user] hello world</s>\n[assistant] "
    ids = hf_tok.encode_chat(messages)
    # The template's BOS is the only one: no second BOS added on top.
    assert ids.count(hf_tok.bos_token_id) == 1 and ids[0] == hf_tok.bos_token_id
    assert ids.count(hf_tok.eos_token_id) == 2
    with pytest.raises(ValueError, match="no tools here"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}])

    # A template in chat_template.jinja (newer checkpoints) and a list of named templates.
    folder = _build_hf_folder(tmp_path / "jinja", chat_template=None)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"
    named = HFTokenizer(folder / "tokenizer.json", {"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    assert named.apply_chat_template([{"role": "user", "content": "x"}]) == "D"
    bare = HFTokenizer(folder / "tokenizer.json", {})
    with pytest.raises(ValueError, match="no chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_hf_chat_template_is_sandboxed(tmp_path):
    folder = _build_hf_folder(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_load_tokenizer_without_tokenizer_json(tmp_path):
    assert load_tokenizer(tmp_path) is None


# ---------------------------------------------------------------------------- detokenizer
def test_multibyte_characters_are_never_split():
    tok = ByteTokenizer()
    text = "aé€𝄞b東京"
    deltas, rest = _feed_one_by_one(IncrementalDetokenizer(tok), list(text.encode()))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text and rest == ""
    # The 4-byte character appears whole on the step that completes it.
    assert "𝄞" in deltas[len("aé€".encode()) + 3]


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=0, max_size=30), cuts=st.lists(st.integers(1, 5), max_size=30))
def test_any_chunking_reassembles_the_text(text, cuts):
    tok = ByteTokenizer()
    data = list(text.encode())
    detok = IncrementalDetokenizer(tok)
    deltas, i = [], 0
    for size in cuts + [len(data)]:
        if i >= len(data):
            break
        deltas.append(detok.feed(data[i:i + size]))
        i += size
    deltas.append(detok.flush())
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


def test_incomplete_character_at_the_end_is_flushed_as_replacement():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.feed(list(b"ok")) == "ok"
    assert detok.feed([0xE2, 0x82]) == ""  # the first two bytes of a 3-byte character: held
    assert detok.flush() == "\ufffd"


def test_stop_string_truncates_and_is_never_streamed():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=("STOP", "never"))
    deltas = []
    for b in b"abc STOP def":
        deltas.append(detok.feed([b]))
        if detok.stopped:
            break
    assert detok.stopped and detok.text == "abc "
    assert "".join(deltas) + detok.flush() == "abc "
    assert not any("S" in d for d in deltas)
    assert detok.feed(list(b"more")) == ""  # nothing after a stop


def test_held_prefix_released_when_it_does_not_become_a_stop():
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("STOP",))
    assert detok.feed(list(b"a ST")) == "a "
    assert detok.feed(list(b"ART")) == "START"
    assert detok.feed(list(b" S")) == " "
    assert detok.flush() == "S" and not detok.stopped


def test_earliest_stop_wins_across_tokens():
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=("cd", "b"))
    assert detok.feed(list(b"abcd")) == "a"
    assert detok.stopped and detok.text == "a"


def test_hf_incremental_matches_full_decode(hf_tok):
    text = "hello world, naïve café 東京 😀 the lazy dog"
    prompt = hf_tok.encode("the quick")
    ids = hf_tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(hf_tok, stop=(), prompt_token_ids=prompt)
    deltas, rest = _feed_one_by_one(detok, ids)
    assert "".join(deltas) + rest == text == detok.text
    assert all("\ufffd" not in d for d in deltas)

    detok = IncrementalDetokenizer(hf_tok, stop=("café",), prompt_token_ids=prompt)
    out = "".join(detok.feed([i]) for i in ids) + detok.flush()
    assert detok.stopped and out == "hello world, naïve "
