"""Incremental detokenization: UTF-8 hold-back, stop strings across tokens, sliding-window cost."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from text.detokenizer import Delta, IncrementalDecoder, truncate_at_stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FFFD = "\ufffd"


# --- helpers -------------------------------------------------------------------------------------
def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: every id is one byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def piece_decoder(pieces: list[str]):
    """A tokenizer whose token i is the string pieces[i] (multi-character tokens)."""
    return lambda ids: "".join(pieces[i] for i in ids)


def stream(dec: IncrementalDecoder, chunks) -> list[Delta]:
    return [dec.push(list(c)) for c in chunks]


def one_by_one(ids):
    return [[i] for i in ids]


def random_chunks(ids, rng: random.Random, max_chunk: int = 4):
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        out.append(ids[i : i + n])
        i += n
    return out


def run_stream(decode, chunks, stop=None, prompt=None, check_prefix_of: str | None = None):
    """Stream ``chunks``; return (deltas, flushed, all text). Checks the invariants every step."""
    dec = IncrementalDecoder(decode, prompt, stop)
    deltas, emitted = [], ""
    for c in chunks:
        d = dec.push(list(c))
        deltas.append(d)
        emitted += d.text
        assert dec.text == emitted
        for s in dec.stop:
            assert s not in d.text
        if check_prefix_of is not None:
            assert check_prefix_of.startswith(emitted), (emitted, check_prefix_of)
    flushed = dec.flush()
    emitted += flushed
    assert dec.text == emitted
    assert dec.token_count <= sum(len(c) for c in chunks)
    return deltas, flushed, emitted, dec


# --- (1) byte-level: multi-byte characters split across tokens ------------------------------------
def test_emoji_as_four_tokens_is_held_until_complete():
    dec = IncrementalDecoder(byte_decode)
    ids = byte_ids("😀")
    assert len(ids) == 4
    texts = [dec.push([i]).text for i in ids]
    assert texts == ["", "", "", "😀"]
    assert dec.flush() == ""
    assert dec.text == "😀" and dec.token_count == 4


def test_two_byte_char_and_mixed_text_never_emit_replacement_char():
    dec = IncrementalDecoder(byte_decode)
    assert dec.push([0xC3]).text == ""
    assert dec.push([0xA9]).text == "é"
    text = "héllo 😀 wörld — 東京 ok"
    deltas, flushed, out, _ = run_stream(byte_decode, one_by_one(byte_ids(text)))
    assert out == text and flushed == ""
    assert all(FFFD not in d.text for d in deltas)
    assert all(not d.stopped and d.stop_string is None for d in deltas)


def test_ascii_is_emitted_immediately_around_partial_chars():
    dec = IncrementalDecoder(byte_decode)
    assert dec.push(byte_ids("ab")).text == "ab"
    assert dec.push(byte_ids("c") + [0xF0, 0x9F]).text == "c"  # stable part goes out, partial held
    assert dec.push([0x98]).text == ""
    assert dec.push([0x80] + byte_ids("d")).text == "😀d"


def test_flush_releases_an_incomplete_character():
    dec = IncrementalDecoder(byte_decode)
    assert dec.push(byte_ids("hi") + [0xF0, 0x9F]).text == "hi"
    assert dec.flush() == FFFD  # what decode() of the whole output gives
    assert dec.text == byte_decode(byte_ids("hi") + [0xF0, 0x9F])
    assert dec.flush() == ""
    with pytest.raises(RuntimeError):
        dec.push([65])


def test_invalid_bytes_mid_stream_are_emitted_once_followed_by_text():
    ids = [0x61, 0xFF, 0x62, 0x80, 0xE2, 0x82, 0x63]
    deltas, flushed, out, _ = run_stream(byte_decode, one_by_one(ids))
    assert out == byte_decode(ids)
    assert out.count(FFFD) == 3


def test_random_chunking_reconstructs_the_full_decode():
    rng = random.Random(0)
    text = "naïve café 😀🚀 東京 — “quotes” ñ ü 中文字符 \n\t end" * 3
    ids = byte_ids(text)
    for _ in range(50):
        deltas, _, out, _ = run_stream(byte_decode, random_chunks(ids, rng, 6), check_prefix_of=text)
        assert out == text
        assert all(FFFD not in d.text for d in deltas)


def test_random_bytes_reconstruct_the_full_lossy_decode():
    rng = random.Random(1)
    pool = [0x41, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 0x80, 0xBF]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 20))]
        _, _, out, _ = run_stream(byte_decode, random_chunks(ids, rng, 3))
        assert out == byte_decode(ids), ids


def test_prompt_context_is_not_emitted():
    prompt = byte_ids("Question: é? ")
    out_ids = byte_ids("Answer 😀")
    _, _, out, _ = run_stream(byte_decode, one_by_one(out_ids), prompt=prompt)
    assert out == "Answer 😀"


def test_prompt_ending_inside_a_character_is_dropped_as_context():
    prompt = byte_ids("abc") + [0xF0, 0x9F]  # truncated mid-emoji
    _, _, out, _ = run_stream(byte_decode, one_by_one([0x98, 0x80] + byte_ids("x")), prompt=prompt)
    assert out == byte_decode([0x98, 0x80] + byte_ids("x"))


def test_leading_space_rule_uses_prompt_context():
    """A SentencePiece-like decode drops the leading space of the first token; with prompt
    context the output keeps it, without it the output equals decode(output ids)."""
    pieces = ["▁Hello", "▁world", "!", "▁again"]

    def sp_decode(ids):
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    _, _, out, _ = run_stream(sp_decode, one_by_one([1, 2, 3]), prompt=[0])
    assert out == " world! again"
    _, _, out, _ = run_stream(sp_decode, one_by_one([1, 2, 3]))
    assert out == sp_decode([1, 2, 3]) == "world! again"


def test_decode_work_is_linear_in_output_length():
    calls = []

    def counting_decode(ids):
        calls.append(len(ids))
        return byte_decode(ids)

    text = ("streaming text with é and 😀 and 東京. " * 200)[:6000]
    dec = IncrementalDecoder(counting_decode, byte_ids("prompt " * 50), stop=["NEVER_THERE"])
    out = "".join(dec.push([i]).text for i in byte_ids(text)) + dec.flush()
    n = len(byte_ids(text))
    assert out == text
    assert max(calls) <= 10  # a sliding window, not the whole output
    assert sum(calls) <= 6 * n


def test_module_imports_no_torch():
    code = (
        "import sys; from text import detokenizer; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- (2) a real byte-level BPE tokenizer -----------------------------------------------------------
REAL_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé über — “quotes” and ‘apostrophes’",
    "Emoji: 😀 🚀 🎉🎉 👩‍💻 🇫🇷!",
    "CJK: 東京 中文字符 こんにちは 한국어",
    "  leading spaces,   runs of   spaces, tabs\tand\nnew\n\nlines  ",
    "mixed: ñandú ø å ß € ¥ ½ µ 🦀 Ωmega",
]


@pytest.fixture(scope="module")
def tok():
    from scripts.make_test_model import train_tokenizer

    return train_tokenizer(1000, with_pad=False)


@pytest.fixture(scope="module")
def tok_decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def test_real_tokenizer_streams_exactly_the_full_decode(tok, tok_decode):
    split_chars = 0
    for text in REAL_TEXTS:
        ids = tok.encode(text)
        full = tok_decode(ids)
        assert full == text
        split_chars += sum(FFFD in tok_decode([i]) for i in ids)
        deltas, _, out, _ = run_stream(tok_decode, one_by_one(ids), check_prefix_of=full)
        assert out == full
        assert all(FFFD not in d.text for d in deltas)
        _, _, out, _ = run_stream(tok_decode, one_by_one(ids), prompt=tok.encode("Say: "))
        assert out == full
    assert split_chars > 0  # the texts do split characters across tokens


def test_real_tokenizer_skips_special_tokens(tok, tok_decode):
    eos = tok.eos_token_id
    ids = tok.encode("hello 😀") + [eos] + tok.encode(" 東京") + [eos]
    _, _, out, _ = run_stream(tok_decode, one_by_one(ids))
    assert out == tok_decode(ids) == "hello 😀 東京"


def test_real_tokenizer_random_ids_match_full_decode(tok, tok_decode):
    rng = random.Random(2)
    for _ in range(150):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 25))]
        _, _, out, _ = run_stream(tok_decode, random_chunks(ids, rng, 3))
        assert out == tok_decode(ids), ids


# --- (3) stop strings ------------------------------------------------------------------------------
def test_stop_string_split_across_tokens():
    dec = IncrementalDecoder(byte_decode, stop=["END"])
    assert dec.push(byte_ids("abc")) == Delta("abc")
    assert dec.push(byte_ids("E")) == Delta("")  # may be the start of END: held
    assert dec.push(byte_ids("N")) == Delta("")
    assert dec.push(byte_ids("D")) == Delta("", True, "END")
    assert dec.stopped and dec.stop_string == "END" and dec.finished
    assert dec.push(byte_ids(" more")) == Delta("", True, "END")  # nothing after a stop
    assert dec.flush() == ""
    assert dec.text == "abc" and dec.token_count == 6


def test_stop_string_inside_one_token_with_text_around_it():
    pieces = ["hello ", "fooSTOPbar", "baz"]
    dec = IncrementalDecoder(piece_decoder(pieces), stop=["STOP"])
    assert dec.push([0]) == Delta("hello ")
    assert dec.push([1]) == Delta("foo", True, "STOP")
    assert dec.push([2]) == Delta("", True, "STOP")
    assert dec.text == "hello foo"


def test_stop_string_spanning_three_multi_char_tokens():
    pieces = ["x <|e", "nd", "|> y"]
    deltas, flushed, out, dec = run_stream(piece_decoder(pieces), [[0], [1], [2]], stop=["<|end|>"])
    assert [d.text for d in deltas] == ["x ", "", ""] and flushed == ""
    assert out == "x " and dec.stop_string == "<|end|>"


def test_earliest_stop_wins_regardless_of_list_order():
    text = "a STOP b END c"
    for stop in (["END", "STOP"], ["STOP", "END"]):
        for chunks in ([byte_ids(text)], one_by_one(byte_ids(text))):
            _, _, out, dec = run_stream(byte_decode, chunks, stop=stop)
            assert out == "a " and dec.stop_string == "STOP"
    assert truncate_at_stop(text, ["END", "STOP"]) == ("a ", "STOP")


def test_first_stop_to_complete_wins_and_ties_go_to_the_longest():
    # "C" completes before "BCD" could: streaming can stop at once, so C wins everywhere.
    for chunks in ([byte_ids("ABCD")], one_by_one(byte_ids("ABCD"))):
        _, _, out, dec = run_stream(byte_decode, chunks, stop=["BCD", "C"])
        assert (out, dec.stop_string) == ("AB", "C")
    assert truncate_at_stop("ABCD", ["BCD", "C"]) == ("AB", "C")
    # Both complete on "D": the earlier start (longer) wins.
    for chunks in ([byte_ids("ABCD")], one_by_one(byte_ids("ABCD"))):
        _, _, out, dec = run_stream(byte_decode, chunks, stop=["CD", "BCD"])
        assert (out, dec.stop_string) == ("A", "BCD")
    # Same start: the shorter completes first.
    _, _, out, dec = run_stream(byte_decode, one_by_one(byte_ids("xEND")), stop=["END", "EN"])
    assert (out, dec.stop_string) == ("x", "EN")


def test_false_start_releases_the_held_text():
    deltas, flushed, out, dec = run_stream(byte_decode, one_by_one(byte_ids("xENXy")), stop=["END"])
    assert [d.text for d in deltas] == ["x", "", "", "ENX", "y"]
    assert out == "xENXy" and not dec.stopped and dec.stop_string is None and flushed == ""


def test_partial_stop_at_finish_is_flushed():
    dec = IncrementalDecoder(byte_decode, stop=["END"])
    assert dec.push(byte_ids("abcEN")).text == "abc"
    assert dec.flush() == "EN"
    assert dec.text == "abcEN" and not dec.stopped


def test_overlapping_stop_prefixes():
    # "ABAB": the held suffix moves from "ABA" to "AB"; the first "AB" is released.
    deltas, _, out, dec = run_stream(byte_decode, one_by_one(byte_ids("ABABAC!")), stop=["ABAC"])
    assert [d.text for d in deltas[:4]] == ["", "", "", "AB"]
    assert out == "AB" and dec.stop_string == "ABAC"


def test_longest_held_suffix_across_several_stop_strings():
    dec = IncrementalDecoder(byte_decode, stop=["xyz", "yzw!"])
    assert dec.push(byte_ids("axy")).text == "a"  # "xy" prefixes xyz
    assert dec.push(byte_ids("z")) == Delta("", True, "xyz")
    dec = IncrementalDecoder(byte_decode, stop=["xyq", "yzw!"])
    assert dec.push(byte_ids("axyz")).text == "ax"  # "yz" prefixes yzw!
    assert dec.push(byte_ids("wq")).text == "yzwq"


def test_multibyte_stop_strings_and_partial_chars():
    ids = byte_ids("hi 😀 there")
    _, _, out, dec = run_stream(byte_decode, one_by_one(ids), stop=["😀"])
    assert out == "hi " and dec.stop_string == "😀"
    # The stop string starts with "é": its partial bytes must not release "é" early.
    deltas, _, out, dec = run_stream(byte_decode, one_by_one(byte_ids("caféé!")), stop=["é!"])
    assert out == "café" and dec.stop_string == "é!"
    assert all(FFFD not in d.text for d in deltas)


def test_stop_completed_by_flushed_text_still_cuts():
    dec = IncrementalDecoder(byte_decode, stop=["a" + FFFD])
    assert dec.push(byte_ids("xa") + [0xF0]).text == "x"
    assert dec.flush() == ""
    assert dec.stopped and dec.text == "x"
    assert truncate_at_stop(byte_decode(byte_ids("xa") + [0xF0]), ["a" + FFFD]) == ("x", "a" + FFFD)


def test_no_stop_strings_and_empty_stop_strings_hold_nothing():
    for stop in (None, [], [""], ""):
        dec = IncrementalDecoder(byte_decode, stop=stop)
        assert dec.stop == ()
        assert dec.push(byte_ids("E")) == Delta("E")
    assert IncrementalDecoder(byte_decode, stop="END").stop == ("END",)
    assert IncrementalDecoder(byte_decode, stop=["a", "a", ""]).stop == ("a",)
    assert IncrementalDecoder(byte_decode).push([]) == Delta("")


def test_truncate_at_stop():
    assert truncate_at_stop("hello world", None) == ("hello world", None)
    assert truncate_at_stop("hello world", []) == ("hello world", None)
    assert truncate_at_stop("hello world", ["o w"]) == ("hell", "o w")
    assert truncate_at_stop("hello world", "l") == ("he", "l")
    assert truncate_at_stop("hello world", ["xyz", ""]) == ("hello world", None)
    assert truncate_at_stop("END", ["END"]) == ("", "END")


def test_stop_on_real_tokenizer_tokens(tok, tok_decode):
    text = "café naïve résumé — 東京 😀 over the lazy dog"
    ids = tok.encode(text)
    for stop in (["東京"], ["😀"], ["lazy", "naï"], ["ver"], [" "], ["dog"], ["absent"]):
        expected, matched = truncate_at_stop(text, stop)
        _, _, out, dec = run_stream(tok_decode, one_by_one(ids), stop=stop, check_prefix_of=expected)
        assert (out, dec.stop_string, dec.stopped) == (expected, matched, matched is not None)


# --- property-style: streaming == truncate_at_stop(full decode) ------------------------------------
PIECES = ["a", "b", "E", "N", "D", "END", "EN", "X", " ", "\n", "é", "😀", "東", "ab", "ba", "<|", "|>", "xyz", "STOP"]
STOP_POOL = ["END", "EN", "NDX", "😀", "é", "\n\n", "ab", "bab", "<|end|>", "STOP", "D", "é😀", "Xé"]


def test_property_byte_stream_matches_non_streaming_truncate():
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 25)))
        stop = rng.sample(STOP_POOL, rng.randint(0, 3))
        expected, matched = truncate_at_stop(text, stop)
        chunks = random_chunks(byte_ids(text), rng, rng.choice([1, 2, 5]))
        deltas, flushed, out, dec = run_stream(byte_decode, chunks, stop=stop, check_prefix_of=expected)
        assert out == expected, (text, stop)
        assert dec.stopped == (matched is not None) and dec.stop_string == matched
        assert all(FFFD not in d.text for d in deltas) and FFFD not in flushed
        if matched is not None:
            assert flushed == ""
            stop_at = next(i for i, d in enumerate(deltas) if d.stopped)
            assert all(d == Delta("", True, matched) for d in deltas[stop_at + 1 :])


def test_property_real_tokenizer_matches_non_streaming_truncate(tok, tok_decode):
    rng = random.Random(99)
    for _ in range(120):
        text = "".join(rng.choice(PIECES + [" the", " fox", "ñ", "🚀", "中文"]) for _ in range(rng.randint(1, 20)))
        ids = tok.encode(text)
        full = tok_decode(ids)
        stop = rng.sample(STOP_POOL, rng.randint(0, 3))
        expected, matched = truncate_at_stop(full, stop)
        _, _, out, dec = run_stream(tok_decode, random_chunks(ids, rng, 2), stop=stop, check_prefix_of=expected)
        assert (out, dec.stop_string) == (expected, matched), (text, stop)
