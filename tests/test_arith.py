"""The demo task: scratchpad answers, splits that never overlap, the checker, the tokenizer."""

from __future__ import annotations

import pytest

from benchmarks import arith


def test_answer_works_the_columns():
    assert arith.answer_text(407, 96) == "7+6+0=13c1;0+9+1=10c1;4+0+1=5c0;#503"
    assert arith.answer_text(0, 0) == "0+0+0=0c0;#0"
    assert arith.answer_text(99999, 1).endswith(";#100000")


def test_splits_are_disjoint_reproducible_and_varied():
    train = arith.sample("train", 2000, seed=0)
    test = arith.sample("test", 300, seed=0)
    assert not set(train) & set(test)
    assert all(arith.is_test(a, b) for a, b in test) and not any(arith.is_test(*p) for p in train)
    assert arith.sample("test", 300, seed=0) == test  # fixed seeds
    assert len(set(train)) == 2000
    lengths = {len(arith.answer_text(a, b)) for a, b in test}
    assert min(lengths) < 20 and max(lengths) > 50  # answers of varying length
    with pytest.raises(ValueError, match="split"):
        arith.sample("dev", 1, 0)


def test_check():
    a, b = 407, 96
    good = arith.answer_text(a, b) + arith.EOS * 3
    assert arith.check(a, b, good)
    assert arith.check(a, b, "wrong scratchpad;#503")  # only the result counts
    assert not arith.check(a, b, "7+6+0=13c1;#504")
    assert not arith.check(a, b, "no result")
    assert not arith.check(a, b, "#5x3")
    assert not arith.check(a, b, f"#50{arith.EOS}3")


def test_tokenizer_round_trip(tmp_path):
    from lacache_jax.tokenizer import Tokenizer
    arith.write_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = arith.special_ids()
    text = arith.prompt_text(407, 96) + arith.answer_text(407, 96) + arith.EOS
    enc = tok.encode(text)
    assert tok.decode(enc) == text
    assert enc[0] == ids[arith.USER] and enc[-1] == ids[arith.EOS]
    assert len(enc) == len(text) - sum(len(s) - 1 for s in (arith.USER, arith.ASSISTANT,
                                                            arith.EOS))  # one id per char
    assert tok.encode(arith.MASK) == [ids[arith.MASK]]
    assert tok.chat_prompt("407+96=") == arith.prompt_text(407, 96)
