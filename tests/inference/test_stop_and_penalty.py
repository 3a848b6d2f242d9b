"""Stop strings and the repetition penalty: the text shown while tokens stream (held back while it may begin a
stop string, cut before one), CTRL's penalty by hand, generate() with both, and `llmc sample --stop
--repetition-penalty` (the text cut as the API cuts it, bad values one line naming the flag)."""

from __future__ import annotations

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.inference.sampling import generate, penalize
from llmc_cli.inference.stops import StopText
from llmc_cli.models.gpt2 import GPT2, GPT2Config, init_parameters

SMALL = GPT2Config(block_size=32, vocab_size=97, n_layer=1, n_head=2, n_embd=16)


class Pieces:
    """A tokenizer whose token i is the i-th byte string of a list (decode_bytes is all StopText needs)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.pieces[i] for i in ids)


def shown(stops, pieces: list[bytes]) -> tuple[list[bytes], bytes, bool]:
    """What StopText gives out per token, what it holds at the end, and whether a stop string ended the text."""
    text = StopText(stops, Pieces(pieces).decode_bytes)
    out = [text.add(i) for i in range(len(pieces))]
    return out, text.rest(), text.stopped


@pytest.mark.parametrize("stops, pieces, out, rest, stopped", [
    ((), [b"ab", b"cd"], [b"ab", b"cd"], b"", False),                      # no stop strings: every byte at once
    (("\n\n",), [b"a\n", b"\nb", b"c"], [b"a", b"", b""], b"", True),      # across two tokens, cut before it
    (("\n\n",), [b"a\n", b"b"], [b"a", b"\nb"], b"", False),               # held back, then let out
    (("END",), [b"xEND", b"more"], [b"x", b""], b"", True),                 # inside one token: what follows is gone
    (("END",), [b"E", b"N", b"x"], [b"", b"", b"ENx"], b"", False),        # a prefix that turns out not to be one
    (("END",), [b"aE", b"N"], [b"a", b""], b"EN", False),                  # the text ends mid-prefix: shown at the end
    (("EEX",), [b"E", b"E", b"E", b"X"], [b"", b"", b"E", b""], b"", True),  # the held part slides along
    (("cd", "bc"), [b"abcd"], [b"a"], b"", True),                          # the earliest stop string wins
    (("\u00e9t\u00e9",), ["\u00e9".encode(), "t\u00e9!".encode()], [b"", b""], b"", True),  # UTF-8 text
])
def test_stop_text_shows_what_precedes_a_stop_string(stops, pieces, out, rest, stopped):
    assert shown(stops, pieces) == (out, rest, stopped)


@pytest.mark.parametrize("stop, needle", [
    ("", "stop must hold non-empty strings"), ([""], "non-empty"), ([b"x"], "non-empty strings"),
    (5, "stop must be a string or a list of strings"), (["\udcff"], "is not UTF-8 text"),
])
def test_stop_text_refuses_what_could_never_match(stop, needle):
    with pytest.raises(ValueError, match=needle) as e:
        StopText(stop, Pieces([]).decode_bytes)
    assert "\n" not in str(e.value)


def test_penalize_divides_positive_logits_and_multiplies_the_rest():
    logits = np.array([2.0, -2.0, 0.0, 3.0, 1.0], dtype=np.float32)
    got = penalize(logits, [0, 1, 2, 0, 9], 2.0)  # 9: past the logits (a vocabulary limit), skipped
    assert got.tolist() == [1.0, -4.0, 0.0, 3.0, 1.0]
    assert penalize(logits, [3, 1], 0.5).tolist() == [2.0, -1.0, 0.0, 6.0, 1.0]  # below 1: repeats favoured
    assert penalize(logits, [0, 1], 1.0) is logits and logits[0] == 2.0  # off: untouched, no copy


def small_model(backend, T: int = 32) -> GPT2:
    p = init_parameters(SMALL, 0)
    p[SMALL.padded_vocab_size * SMALL.n_embd:] += np.random.default_rng(1).normal(
        0, 0.05, p.size - SMALL.padded_vocab_size * SMALL.n_embd).astype(np.float32)
    p[:SMALL.vocab_size * SMALL.n_embd] *= 5.0  # opinions: greedy decoding repeats itself
    m = GPT2(SMALL, backend, 1, T, training=False)
    m.load_parameters(p)
    return m


def greedy_by_hand(m: GPT2, prompt: list[int], n: int, penalty: float) -> list[int]:
    """Greedy tokens of a full forward per token, the penalty applied by the rule's own words."""
    tokens = list(prompt)
    buf = np.zeros((1, m.T), np.int32)
    for _ in range(n):
        buf[0, :len(tokens)] = tokens
        m.forward(buf)
        logits = m.logits_host(len(tokens) - 1)[0].astype(np.float64)
        for i in set(tokens):
            logits[i] = logits[i] / penalty if logits[i] > 0 else logits[i] * penalty
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


def test_generate_applies_the_repetition_penalty(cpu):
    m = small_model(cpu)
    prompt = [5, 6, 7]
    plain = list(generate(m, prompt, 20, np.random.default_rng(0), temperature=0))
    assert plain == greedy_by_hand(m, prompt, 20, 1.0) and len(set(plain)) < 20  # it repeats itself
    want = {penalty: greedy_by_hand(m, prompt, 20, penalty) for penalty in (1.8, 0.7)}
    for penalty in want:
        for kv in (False, True):
            got = list(generate(m, prompt, 20, np.random.default_rng(0), temperature=0, kv_cache=kv,
                                repetition_penalty=penalty))
            assert got == want[penalty], (penalty, kv)
    assert len(set(want[1.8])) > len(set(plain))  # fewer repeats
    sampled = [list(generate(m, prompt, 20, np.random.default_rng(3), kv_cache=kv, top_k=20, repetition_penalty=1.3))
               for kv in (False, True)]
    assert sampled[0] == sampled[1]


def test_generate_ends_after_the_token_that_completes_a_stop_string(cpu):
    m = small_model(cpu)
    tok = Pieces([bytes([65 + i % 26]) * (1 + i % 3) for i in range(SMALL.vocab_size)])  # "A", "BB", "CCC", ...
    rng = np.random.default_rng
    full = list(generate(m, [1, 2], 24, rng(4)))
    text = tok.decode_bytes(full)
    stop = text[4:7].decode()  # a stop string somewhere past the first tokens, maybe across two of them
    cut = text.index(stop.encode())
    ends = next(i for i in range(len(full)) if stop.encode() in tok.decode_bytes(full[:i + 1]))
    for kv in (False, True):
        got = list(generate(m, [1, 2], 24, rng(4), stop=[stop, "never"], tokenizer=tok, kv_cache=kv))
        assert got == full[:ends + 1], kv  # the token that completes it is the last one
    out, rest, stopped = shown([stop], [tok.pieces[t] for t in got])
    assert b"".join(out) == text[:cut] and stopped and rest == b""
    assert list(generate(m, [1, 2], 24, rng(4), stop=[], tokenizer=None)) == full


@pytest.mark.parametrize("kw, needle", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=-1.2), "repetition_penalty must be"),
    (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"), (dict(repetition_penalty="2"), "repetition_penalty"),
    (dict(stop="\n"), "stop needs tokenizer="), (dict(stop=["x"], tokenizer="gpt2"), "stop needs tokenizer="),
    (dict(stop=[""], tokenizer=Pieces([])), "stop must hold non-empty strings"),
])
def test_generate_names_a_bad_stop_or_penalty(cpu, kw, needle):
    with pytest.raises(ValueError, match=needle) as e:
        list(generate(small_model(cpu), [1, 2], 2, np.random.default_rng(0), **kw))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    p = init_parameters(cfg, 0)
    n = cfg.padded_vocab_size * cfg.n_embd
    p[n:] += np.random.default_rng(0).normal(0, 0.05, p.size - n).astype(np.float32)
    path = tmp_path_factory.mktemp("stop") / "m.bin"
    write_model(path, cfg, p)
    return path


def test_sample_command_stops_before_the_stop_string(model_file):
    common = ["sample", "--backend", "cpu", "--checkpoint", model_file, "--prompt", "Hi", "--max-new-tokens", 24,
              "--seed", 5]
    full = run(*common).stdout
    new = full[len("Hi"):-1]
    stop = next(new[i:i + 3] for i in range(3, len(new) - 3) if "\\" not in new[i:i + 3] and new[i:i + 3].strip())
    got = run(*common, "--stop", "never seen", "--stop", stop).stdout
    assert got == "Hi" + new[:new.index(stop)] + "\n"
    assert run(*common, "--repetition-penalty", 1.0).stdout == full
    assert run(*common, "--repetition-penalty", 3.0).stdout != full


def test_sample_stop_reads_escapes(model_file):
    common = ["sample", "--backend", "cpu", "--checkpoint", model_file, "--max-new-tokens", 3, "--seed", 5]
    assert run(*common, "--prompt", "Hi\n", "--stop", "\\n\\t").exit_code == 0  # (the text is the model's)
    from llmc_cli.commands.options import EscapedText
    assert EscapedText().convert("a\\n\\tb\\\\n\\x", None, None) == "a\n\tb\\n\\x"


@pytest.mark.parametrize("args, needles", [
    (["--repetition-penalty", 0], ["--repetition-penalty must be > 0"]),
    (["--repetition-penalty", -1.5], ["--repetition-penalty", "-1.5"]),
    (["--repetition-penalty", "nan"], ["--repetition-penalty must be a finite number"]),
    (["--stop", ""], ["--stop must be non-empty text"]),
])
def test_sample_refuses_bad_stop_and_penalty(model_file, args, needles):
    r = run("sample", "--backend", "cpu", "--checkpoint", model_file, *args, ok=False)
    one_line_error(r, *needles)
