"""The data a run reads and the tokenizer it records: the loaders of --data and --val-data, and the checks that the
model and the evaluations take ids of that tokenizer. Each refusal is a DataError whose message names the option;
the Trainer raises it as a TrainError."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from llmc_cli.data.loader import DataLoader, ValLoader
from llmc_cli.data.tokenizer import llama3_ranks
from llmc_cli.evals.evaluate import HELLASWAG_REMEDY, check_shards_tokenizer, check_tokenizer
from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.evalfile import read_evalfile_header
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import SHARD_VOCAB, check_tokenize_complete, has_split
from llmc_cli.formats.sources import tokenizer_for
from llmc_cli.naming import arg



@contextmanager
def _option_named(flag: str):
    """A DataError raised inside, with `flag` in front of its message (unless it names an option already)."""
    try:
        yield
    except DataError as e:
        if str(e).startswith(("--", flag)):
            raise
        raise DataError(f"{flag}: {e}") from None


def open_loaders(a, vocab_size: int, comm) -> tuple[DataLoader, ValLoader | None]:
    """The loaders of --data and --val-data (a directory given as --data: its val shards unless --val-data says
    else). Token ids are checked against the model's vocabulary as each shard is first opened; a missing or
    damaged shard is named with the option that led to it."""
    with _option_named(arg("data")):
        train = DataLoader(a.data, a.batch_size, a.seq_len, rank=comm.rank, world_size=comm.world_size,
                           shuffle=a.shuffle, seed=a.seed, vocab_size=vocab_size)
        check_tokenize_complete(train.files)
    val_data = a.val_data or (a.data if isinstance(a.data, str) and has_split(a.data, "val") else None)
    with _option_named(arg("val_data" if a.val_data else "data")):
        val = ValLoader(val_data, a.batch_size, a.seq_len, vocab_size=vocab_size) if val_data else None
        if val is not None:
            check_tokenize_complete(val.files)
    return train, val


def check_shard_vocab(vocab_size: int, train: DataLoader, val: ValLoader | None) -> None:
    """Shards of a tokenizer whose ids the model's vocabulary cannot hold."""
    for opt, loader in ((arg("data"), train), (arg("val_data"), val)):
        need = SHARD_VOCAB.get(loader.tokenizer) if loader is not None else None
        if need and vocab_size < need:
            raise DataError(f"{opt}: the shards were tokenized with the {loader.tokenizer} vocabulary "
                            f"({need:,} ids) but the model's vocab size is {vocab_size:,}; use a "
                            f"{loader.tokenizer} model or re-tokenize the data")


def run_tokenizer(a, train: DataLoader, resume_state: dict | None) -> tuple[str, Path | None]:
    """The run's tokenizer (the data's; a resumed run's: the one it recorded) and the tokenizer file the run keeps,
    which sample and eval read from the run directory. A Llama 3 --init brings its file: checked now, since it is
    copied into the run at its first checkpoint."""
    if resume_state is not None:
        kept = Path(a.out) / ckpt.TOKENIZER_FILE
        return resume_state.get("tokenizer", "gpt2"), kept if kept.is_file() else None  # (no field: GPT-2 shards)
    if not (a.init and train.tokenizer == "llama3"):
        return train.tokenizer, None
    try:
        name, file = tokenizer_for(a.init)
    except ckpt.CheckpointError:  # without the file the run still trains; sample says what is missing
        name, file = "llama3", None
    if name != "llama3" or file is None:
        return train.tokenizer, None
    try:
        llama3_ranks(file)
    except DataError as e:
        raise DataError(f"{arg('init')}: {e}") from None
    return train.tokenizer, file


def check_eval_files(a, val: ValLoader | None, tokenizer: str | None) -> None:
    """Evaluations during the run score the model on ids of its data's tokenizer: val shards or a HellaSwag file
    of another would be scored without complaint (GPT-2 ids all fit a Llama's vocabulary), so they are refused
    before the first step, rather than at the first validation."""
    try:
        if val is not None:
            check_shards_tokenizer(val, tokenizer, "the run")
            if a.val_every > 0:  # (a bad id in a later val shard: one line now, not at a validation mid-run)
                val.check_vocab_of_batches(a.val_batches)
    except DataError as e:
        raise DataError(f"{arg('val_data' if a.val_data else 'data')}: {e}") from None
    if a.hellaswag:
        try:
            check_tokenizer(a.hellaswag, read_evalfile_header(a.hellaswag).tokenizer, tokenizer, "the run",
                            HELLASWAG_REMEDY.format(tokenizer))
        except DataError as e:
            raise DataError(f"{arg('hellaswag')}: {e}") from None
