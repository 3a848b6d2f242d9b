"""`llmc sample`: stream text from any checkpoint."""

from __future__ import annotations

import codecs
import os
import sys
import time

import click
import numpy as np

from llmc_cli.commands.console import (
    BACKEND_OPT_HELP,
    DTYPES,
    backend_options,
    err_console,
    fail,
    make_backend,
    refuse_empty_paths,
    terminal_text,
)
from llmc_cli.commands.options import COUNT, POSITIVE, SEED, EscapedText, Real, ZeroOrReal
from llmc_cli.data.home import DataHomeError
from llmc_cli.data.tokenizer import load_tokenizer
from llmc_cli.formats.files import CheckpointError, DataError
from llmc_cli.formats.sources import load_config_any, tokenizer_for
from llmc_cli.inference.decode import has_kv_cache
from llmc_cli.inference.loading import load_model
from llmc_cli.inference import sampling  # (as a module: tests put a spy in for generate)
from llmc_cli.inference.stops import StopText

PROMPT_MAX_BYTES = 64 * 2**20


def _stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def load_for_inference(checkpoint: str, backend, B: int, T: int):
    """The model of any --checkpoint (GPT-2 or Llama, llmc file, run directory or Hugging Face directory),
    planned for inference at (B, T)."""
    try:
        return load_model(checkpoint, backend, B, T)
    except CheckpointError as e:
        fail(f"--checkpoint: {e}")
    except ValueError as e:
        fail(str(e))


def prompt_text(prompt: str) -> str:
    """--prompt as the text the user typed. Python decodes the command line with the locale's encoding, bytes it
    cannot decode kept as lone surrogates (surrogateescape): under LC_ALL=C a UTF-8 prompt arrives that way. So the
    command line's bytes are taken back (os.fsencode) and read as UTF-8; a ValueError when they are not UTF-8."""
    if not any(0xD800 <= ord(c) <= 0xDFFF for c in prompt):
        return prompt
    try:
        raw = os.fsencode(prompt)
    except UnicodeEncodeError:  # (text that never was the command line's bytes: the API's, a test's)
        raw = prompt.encode("utf-8", "surrogateescape") if all(
            not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in prompt) else None
    if raw is None:
        bad = next(c for c in prompt if 0xD800 <= ord(c) <= 0xDFFF)
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        raise ValueError(f"not UTF-8 text ({what})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte 0x{raw[e.start]:02x})") from None


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt's text from --prompt or --prompt-file ("" for none); fails with one line naming the option."""
    if prompt is not None and prompt_file is not None:
        fail("give --prompt or --prompt-file, not both")
    if prompt is not None:
        try:  # (lone surrogates the tokenizer would make U+FFFD of, silently)
            return prompt_text(prompt)
        except ValueError as e:
            utf8 = sys.getfilesystemencoding().lower().replace("-", "") == "utf8"
            locale = "" if utf8 else " (a UTF-8 locale, e.g. LC_ALL=C.UTF-8)"
            fail(f"--prompt: {e}; give UTF-8{locale}, or the text in a UTF-8 file with --prompt-file")
    if prompt_file is None:
        return ""
    try:
        with open(prompt_file, "rb") as f:
            raw = f.read(PROMPT_MAX_BYTES + 1)  # (/dev/zero or a stray huge file would fill memory)
        if len(raw) > PROMPT_MAX_BYTES:
            fail(f"--prompt-file: {prompt_file}: longer than {PROMPT_MAX_BYTES // 2**20} MiB, expected a text "
                 "prompt (the model sees only its last block of tokens)")
        return raw.decode("utf-8-sig")  # (an editor's byte-order mark is no text: tokenize drops it too)
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--prompt-file: {prompt_file}: {e.strerror if isinstance(e, OSError) else e}")


def _config_and_tokenizer(checkpoint: str):
    """(model config, tokenizer) of --checkpoint, the tokenizer checked to fit the model's vocabulary."""
    try:
        cfg = load_config_any(checkpoint)
        tok_name, tok_file = tokenizer_for(checkpoint)
    except (CheckpointError, DataError) as e:
        fail(f"--checkpoint: {e}")
    try:
        tok = load_tokenizer(tok_name, tok_file)
    except DataError as e:  # the checkpoint's own tokenizer file is the checkpoint's problem; GPT-2's ranks are
        # installed with llmc (a missing package, no home directory: DataHomeError), nothing --checkpoint can fix
        fail(f"--checkpoint: {e}" if tok_file is not None and not isinstance(e, DataHomeError) else str(e))
    if tok.vocab_size > cfg.vocab_size:  # ids the model has no row for: another model's tokenizer (a smaller one
        # may serve a padded vocabulary: generation stays within the tokenizer's ids)
        fail(f"--checkpoint: {tok_file or tok.name}: a tokenizer of {tok.vocab_size:,} tokens, more than the model's "
             f"vocabulary of {cfg.vocab_size:,}: not this model's tokenizer")
    return cfg, tok


def _prompt_ids(prompt: str, tok, vocab_size: int) -> list[int]:
    """GPT-2 documents start with <|endoftext|>, which also seeds an empty prompt (llm.c); Llama 3 documents
    start with <|begin_of_text|>, which Meta's and Hugging Face's tokenizers put before every prompt."""
    prefix = [] if tok.name == "gpt2" else tok.doc_prefix
    ids = prefix + tok.encode(prompt) if prompt else (prefix or [tok.eot])
    if max(ids) >= vocab_size:
        fail(f"the prompt has token id {max(ids)}, outside the model's vocabulary ({vocab_size})")
    return ids


def _one_sample(model, tok, ids: list[int], draw: dict, kv: bool, show, where: str) -> tuple[int, float]:
    """Stream one sample's new tokens to stdout: (tokens, seconds). `draw`: generate's sampling arguments;
    `where`: (checkpoint, backend name), for the line that ends a failed sample."""
    # an incremental decoder holds back only the bytes of an unfinished UTF-8 character: waiting instead for a
    # decoded text that does not end in U+FFFD printed nothing while the model wrote invalid bytes, and decoded
    # everything since the last print again per token (quadratic)
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    shown = StopText(draw["stop"], tok.decode_bytes)  # the text up to a --stop string
    n = 0
    t0 = time.perf_counter()
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # (an overflowing model is one line, below)
            for t in sampling.generate(model, ids, stop_token=tok.eot, kv_cache=kv, vocab_limit=tok.vocab_size,
                                       tokenizer=tok, **draw):
                n += 1
                if text := utf8.decode(shown.add(t)):
                    click.echo(show(text), nl=False, color=True)
    except sampling.NonFiniteLogits as e:  # the weights' fault, not the backend's
        click.echo()
        fail(f"--checkpoint: {where[0]}: {e} (at new token {n + 1})")
    except ValueError as e:  # (a backend's kernel that is announced and missing: one line naming both)
        click.echo()
        fail(f"--backend {where[1]}: {e}")
    seconds = time.perf_counter() - t0
    click.echo(show(utf8.decode(shown.rest(), final=True)), color=True)
    return n, seconds


@click.command()
@click.option("--checkpoint", required=True,
              help="Run directory (uses its latest), step directory, llm.c .bin, or Hugging Face directory.")
@click.option("--prompt", default=None, help="Text to continue (default: start from end-of-text).")
@click.option("--prompt-file", default=None, type=click.Path(), help="Read the prompt from this text file.")
@click.option("--max-new-tokens", type=COUNT, default=128, show_default=True, help="Tokens to generate per sample.")
@click.option("--num-samples", type=POSITIVE, default=1, show_default=True, help="Independent samples (one rng).")
@click.option("--temperature", type=ZeroOrReal(1e-6), default=1.0, show_default=True,
              help="0 = greedy; else at least 1e-6 (below it the logits' quotient overflows).")
@click.option("--top-k", type=COUNT, default=0, show_default=True, help="Sample among the k most likely (0 = all).")
@click.option("--top-p", type=Real(0, 1, min_open=True), default=1.0, show_default=True, help="Nucleus mass (1.0 = off).")
@click.option("--repetition-penalty", type=Real(0, min_open=True), default=1.0, show_default=True,
              help="Divide the logits of tokens already in the context by this (multiply negative ones); 1.0 = off.")
@click.option("--stop", multiple=True, type=EscapedText(), metavar="TEXT",
              help="End a sample where its text reaches TEXT (repeatable; \\n, \\t are escapes). "
                   "TEXT is not printed (as llama.cpp's server and OpenAI's API do).")
@click.option("--seed", type=SEED, default=1337, show_default=True)
@click.option("--no-kv-cache", is_flag=True, help="Recompute the whole window per token (for comparison).")
@click.option("--backend", default="auto", show_default=True)
@click.option("--device", default=None)
@click.option("--backend-opt", "backend_opt", multiple=True, metavar="KEY=VALUE", help=BACKEND_OPT_HELP)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True)
def sample(checkpoint, prompt, prompt_file, max_new_tokens, num_samples, temperature, top_k, top_p,
           repetition_penalty, stop, seed, no_kv_cache, backend, device, backend_opt, dtype) -> None:
    """Generate text from a trained GPT-2 or Llama 3, streaming it as it comes; tokens/s goes to stderr at the end.
    The tokenizer is the checkpoint's: GPT-2's, or a Llama directory's tokenizer.model.
    Uses a key/value cache where the backend has one (each new token costs one position, not the window).

    \b
    Example:
      llmc sample --checkpoint checkpoints/shakespeare --prompt "ROMEO:" --max-new-tokens 200 --top-k 40
      llmc sample --checkpoint hf/gpt2 --prompt-file prompt.txt --num-samples 3 --top-p 0.9 --temperature 0.8
    """
    refuse_empty_paths(("checkpoint",), checkpoint=checkpoint, prompt_file=prompt_file)
    prompt = _read_prompt(prompt, prompt_file)
    cfg, tok = _config_and_tokenizer(checkpoint)
    ids = _prompt_ids(prompt, tok, cfg.vocab_size)
    be = make_backend(backend, device, dtype, backend_options(backend_opt))
    window = min(cfg.block_size, max(64, -(-(len(ids) + max_new_tokens) // 64) * 64))
    model = load_for_inference(checkpoint, be, 1, window)
    kv = has_kv_cache(model) and not no_kv_cache
    draw = dict(max_new_tokens=max_new_tokens, rng=np.random.default_rng(seed), temperature=temperature,
                top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, stop=stop)
    total, seconds = 0, 0.0
    # a model's text can hold any bytes: on a terminal an escape sequence is shown, not obeyed (into a pipe or a
    # file the text goes as the model wrote it)
    show = terminal_text if _stdout_is_terminal() else (lambda text: text)
    for i in range(num_samples):
        if num_samples > 1:
            click.echo(f"{'' if i == 0 else chr(10)}--- sample {i + 1}/{num_samples} ---")
        if prompt:
            click.echo(show(prompt), nl=False, color=True)  # (color: click would strip some escapes, not all)
        n, took = _one_sample(model, tok, ids, draw, kv, show, (checkpoint, be.name))
        total, seconds = total + n, seconds + took
    err_console.print(f"{total} tokens in {seconds:.2f} s: {total / max(seconds, 1e-9):.1f} tok/s "
                      f"({'KV cache' if kv else 'full recomputation'}, {be.name})")
