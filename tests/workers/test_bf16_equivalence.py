"""The equivalence figures script (loadgen/equivalence.py): the near-tie rule, the figures'
arithmetic, and a small real run of one family in float32 and bfloat16 against transformers."""

from __future__ import annotations

import pytest

from mqinfer.loadgen.equivalence import (
    Reference,
    Shape,
    compare,
    figures_for,
    format_table,
    is_near_tie,
    main,
    make_prompts,
    run_family,
)


def ref(tokens, ties=()):
    """A reference whose best score is 10.0 and second 9.0, except at ``ties`` (10.0 vs 10.0005)."""
    top2 = []
    for i, t in enumerate(tokens):
        second = 10.0005 if i in ties else 9.0
        top2.append((t, 10.0 if i not in ties else 10.001, t + 1, second))
    return Reference(list(tokens), top2)


def test_near_tie_rule():
    assert is_near_tie(10.0, 10.0009)  # 9e-4 / 10 = 9e-5 relative
    assert not is_near_tie(10.0, 10.0011)
    assert is_near_tie(-3.0, -3.0)
    assert not is_near_tie(0.0, 1e-9)  # nothing is relatively close to zero but zero


def test_compare_verdicts():
    r = ref([5, 6, 7, 8], ties={2})
    assert compare([5, 6, 7, 8], r).verdict == "identical"
    assert compare([5, 6, 7, 8], r).first_difference is None
    # A different token where the reference has no tie.
    assert compare([5, 9, 7, 8], r) == compare([5, 9, 1, 1], r)
    assert (compare([5, 9, 7, 8], r).verdict, compare([5, 9, 7, 8], r).first_difference) == ("different", 1)
    # The reference's runner-up at a near-tie counts; what follows is not compared.
    c = compare([5, 6, 8, 0], r)
    assert (c.verdict, c.first_difference) == ("near_tie", 2)
    # At a near-tie, a token that is neither of the two best is still a difference.
    assert compare([5, 6, 42, 8], r).verdict == "different"
    # Shorter output: a difference at the first missing position.
    assert (compare([5, 6], r).verdict, compare([5, 6], r).first_difference) == ("different", 2)


def test_figures_arithmetic_and_table():
    refs = [ref([1, 2, 3], ties={1}), ref([4, 5, 6]), ref([7, 8, 9]), ref([1, 1, 1], ties={0, 2})]
    outputs = [[1, 3, 0], [4, 5, 6], [7, 0, 9], [1, 1, 1]]
    f = figures_for("Llama", "bfloat16", outputs, refs)
    assert (f.num_requests, f.num_identical, f.num_near_tie, f.num_different) == (4, 2, 1, 1)
    assert f.identical_share == 0.5
    assert f.first_differences == [1, 1] and f.mean_first_difference == 1.0
    assert (f.num_tie_positions, f.num_positions) == (3, 12)
    table = format_table([f])
    assert table.splitlines()[1].split() == ["Llama", "bfloat16", "4", "50.0%", "(2)", "1", "1", "1.0", "3/12"]
    with pytest.raises(ValueError):
        figures_for("Llama", "float32", outputs[:2], refs)


def test_prompts_are_seeded_and_share_a_prefix():
    a = make_prompts(8, 512, seed=3)
    assert a == make_prompts(8, 512, seed=3) and a != make_prompts(8, 512, seed=4)
    assert a[0][:40] == a[4][:40]
    assert all(2 <= len(p) <= 96 and all(3 <= t < 512 for t in p) for p in a)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def test_a_real_run_float32_matches_and_bfloat16_is_reported(tmp_path):
    shape = Shape(hidden_size=64, intermediate_size=128, vocab_size=300)
    prompts = make_prompts(10, shape.vocab_size, seed=1)
    f32, bf16 = run_family("Qwen3", ["float32", "bfloat16"], prompts, 12, tmp_path, shape, seed=1, num_threads=1)
    assert (f32.dtype, bf16.dtype) == ("float32", "bfloat16")
    # float32: every request is identical, or differs only at a reference near-tie.
    assert f32.num_requests == 10 and f32.num_different == 0
    assert f32.num_identical + f32.num_near_tie == 10
    assert f32.num_positions == bf16.num_positions == 120
    assert bf16.num_identical + bf16.num_near_tie + bf16.num_different == 10
    assert all(0 <= d < 12 for d in bf16.first_differences)


def test_command_line_refuses_bad_choices(capsys):
    with pytest.raises(SystemExit):
        main(["--families", "Gemma"])
    assert "choose from Llama, Mistral, Qwen2, Qwen3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prompts", "0"])
