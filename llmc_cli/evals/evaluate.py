"""Evaluations: mean validation loss over shards, and HellaSwag accuracy from an eval file; both refuse data
tokenized with another tokenizer than the model's.

HellaSwag is scored the way llm.c (dev/data/hellaswag.py) and lm-eval-harness score it: each example's four
rows `context + ending_i` are one batch (B=4, T = the longest row, right-padded), the per-token losses of the
ending tokens are summed (acc picks the ending with the smallest sum) and divided by the ending's token count
(acc_norm, the completion-normalised score, picks the smallest mean). Padding sits after every real token, so
causal attention keeps it from changing the scored positions; its losses are masked out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from typing import Callable

import numpy as np

from llmc_cli.data.loader import ValLoader
from llmc_cli.formats.evalfile import read_evalfile, read_evalfile_header
from llmc_cli.formats.files import DataError
from llmc_cli.models.base import Model

NUM_ENDINGS = 4


def check_tokenizer(path: str, found: str, expected: str | None, whose: str = "the model",
                    remedy: str = "") -> None:
    """Refuse data tokenized with `found` for a model of tokenizer `expected` (None: unknown, nothing to check):
    the ids would mean other words to the model, and a GPT-2 file's ids all fit a Llama's larger vocabulary, so
    nothing else would notice. One line naming the file and both tokenizers."""
    if expected is not None and found != expected:
        raise DataError(f"{path}: tokenized with {found}, but {whose} uses the {expected} tokenizer"
                        + (f"; {remedy}" if remedy else ""))


def check_shards_tokenizer(loader: ValLoader, expected: str | None, whose: str = "the model") -> None:
    """Every shard of `loader` must be tokenized with `expected` (the first that is not is named)."""
    for info in loader.infos:
        check_tokenizer(info.path, info.tokenizer, expected, whose,
                        f"evaluate on shards made by `llmc tokenize ... --tokenizer {expected}`")


def _count(name: str, v) -> int:
    """`v` as a Python int when it is an integer >= 0 (numpy's too; not a bool, 1.5 or NaN), else a ValueError."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0 = all; got {v!r})")
    return int(v)


def eval_batches(loader: ValLoader, batches: int) -> int:
    """How many batches `evaluate_loss(loader, batches)` runs: `batches`, at most the loader's (0 = all)."""
    batches = _count("batches", batches)
    return loader.num_batches if batches <= 0 else min(batches, loader.num_batches)


def check_model(model, who: str) -> None:
    """A ValueError of one line for something that is not a model (load_model makes one)."""
    if not isinstance(model, Model):
        raise ValueError(f"{who}: model must be a model from llmc.load_model (got {model!r:.80})")


def evaluate_loss(model: Model, loader: ValLoader, batches: int,
                  on_batch: Callable[[int, int], None] | None = None) -> float:
    """Mean loss over the first `batches` batches of the loader, in order (0 = all of them, once);
    `on_batch(done, total)` after each (progress). Shards of another tokenizer than the model's (when it is
    known: `model.tokenizer`), or holding an id outside the model's vocabulary, are refused with a DataError
    naming the shard; a loader of another batch shape than the model's, or a `batches` that is not a count, with
    a ValueError."""
    check_model(model, "evaluate_loss")
    if not isinstance(loader, ValLoader):
        raise ValueError(f"evaluate_loss: loader must be a ValLoader (got {loader!r:.80})")
    batches = _count("batches", batches)
    if (loader.B, loader.T) != (model.B, model.T):
        raise ValueError(f"evaluate_loss: the loader's batches are B={loader.B} T={loader.T} but the model is planned "
                         f"for B={model.B} T={model.T}; give both the same B and T")
    if on_batch is not None and not callable(on_batch):
        raise ValueError(f"evaluate_loss: on_batch must be a function or None (got {on_batch!r:.80})")
    check_shards_tokenizer(loader, model.tokenizer)
    # ids past the model's vocabulary read memory past its embedding table (a segfault on a device): the shards
    # these batches read are checked against it, as a loader given the model's vocab_size checks every shard it opens
    V = model.cfg.vocab_size
    if loader.vocab_size is None or loader.vocab_size > V:
        loader.check_vocab_of_batches(batches, vocab_size=V)
    total, n = 0.0, 0
    todo = eval_batches(loader, batches)
    for x, y in loader.batches(batches):
        model.forward(x, y)
        total += model.mean_loss()
        n += 1
        if on_batch is not None:
            on_batch(n, todo)
    return total / max(n, 1)


def render_example(ex: dict, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs (4,T) int32, targets (4,T) int32, mask (4,T) bool): row i is ctx + ending_i; mask[i, t] says
    that targets[i, t] (the token after inputs[i, t]) is an ending token. Rows longer than T+1 tokens lose
    context tokens from the left (as lm-eval-harness truncates)."""
    ends = ex["ending_tokens"]
    if len(ends) != NUM_ENDINGS:
        raise DataError(f"HellaSwag example {ex.get('index', '?')} has {len(ends)} endings, expected 4")
    x = np.zeros((NUM_ENDINGS, T), np.int32)
    y = np.zeros((NUM_ENDINGS, T), np.int32)
    mask = np.zeros((NUM_ENDINGS, T), bool)
    for i, end in enumerate(ends):
        row = list(ex["ctx_tokens"]) + list(end)
        is_end = [False] * len(ex["ctx_tokens"]) + [True] * len(end)
        row, is_end = row[-(T + 1):], is_end[-(T + 1):]
        n = len(row) - 1
        x[i, :n] = row[:-1]
        y[i, :n] = row[1:]
        mask[i, :n] = is_end[1:]
    return x, y, mask


@dataclass
class HellaSwagResult:
    n: int
    correct: int          # by summed ending loss (acc)
    correct_norm: int     # by mean ending loss per token (acc_norm)
    unscored: int = 0     # examples whose losses were NaN (a model that overflows): then there is no accuracy

    @property
    def acc(self) -> float:
        return float("nan") if self.unscored else self.correct / max(self.n, 1)

    @property
    def acc_norm(self) -> float:
        return float("nan") if self.unscored else self.correct_norm / max(self.n, 1)

    def as_dict(self) -> dict:
        return {"hellaswag_acc": self.acc, "hellaswag_acc_norm": self.acc_norm, "hellaswag_examples": self.n}


HELLASWAG_REMEDY = "tokenize it again with `llmc tokenize hellaswag --tokenizer {0}` (or --checkpoint MODEL)"


class HellaSwag:
    """The examples of one eval file and a B=4 model sharing a given model's parameters, planned once for the
    longest row (capped at the block size). `tokenizer`: the tokenizer of the model it will score, when known
    ahead (a file of another is refused here); each model scored is checked against the file as well."""

    def __init__(self, path: str, limit: int = 0, tokenizer: str | None = None, whose: str = "the model"):
        if isinstance(limit, (bool, np.bool_)) or not isinstance(limit, (int, np.integer)) or limit < 0:
            raise ValueError(f"HellaSwag: limit must be an integer >= 0 (0 = every example; got {limit!r})")
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise ValueError(f"HellaSwag: tokenizer must be a tokenizer's name such as 'gpt2', or None (got "
                             f"{tokenizer!r:.80})")
        if not isinstance(path, (str, os.PathLike)):  # (None or 5 were read as files named 'None' and '5')
            raise ValueError(f"HellaSwag: path must be an eval file's path (got {path!r:.80})")
        self.path = str(path)
        self.tokenizer = read_evalfile_header(path).tokenizer  # whose ids the file holds
        check_tokenizer(self.path, self.tokenizer, tokenizer, whose, HELLASWAG_REMEDY.format(tokenizer))
        self.examples = read_evalfile(path)
        if limit > 0:
            self.examples = self.examples[:int(limit)]
        if not self.examples:
            raise DataError(f"{path}: no examples")
        self.longest = max(len(e["ctx_tokens"]) + max(len(t) for t in e["ending_tokens"]) for e in self.examples)
        self.max_id = max(max(e["ctx_tokens"] + sum(e["ending_tokens"], []), default=0) for e in self.examples)
        self._model: Model | None = None

    def model_for(self, model: Model) -> Model:
        check_model(model, "HellaSwag")
        check_tokenizer(self.path, self.tokenizer, model.tokenizer, remedy=HELLASWAG_REMEDY.format(model.tokenizer))
        cfg = model.cfg
        if self.max_id >= cfg.vocab_size:
            raise DataError(f"{self.path}: token id {self.max_id} is outside the model's vocabulary "
                            f"({cfg.vocab_size})")
        if self._model is None or self._model.params is not model.params:
            T = min(cfg.block_size, self.longest - 1)
            self._model = type(model)(cfg, model.backend, NUM_ENDINGS, max(T, 1), training=False, share_params=model)
        return self._model

    def score(self, model: Model, ex: dict) -> tuple[np.ndarray, np.ndarray]:
        """(summed ending loss (4,), mean ending loss per token (4,)) of one example, float64."""
        m = self.model_for(model)
        x, y, mask = render_example(ex, m.T)
        m.forward(x, y)
        losses = m.backend.download(m.acts["losses"]).astype(np.float64).reshape(NUM_ENDINGS, m.T)
        sums = (losses * mask).sum(axis=1)
        return sums, sums / np.maximum(mask.sum(axis=1), 1)

    def evaluate(self, model: Model, on_example: Callable[[int, int], None] | None = None) -> HellaSwagResult:
        """acc and acc_norm of `model` over the examples; `on_example(done, total)` before each and at the end.
        An example whose losses hold NaN counts as unscored, and any makes both accuracies NaN: np.argmin
        picks the first NaN, so such a model scored as if it chose ending 0 every time."""
        if on_example is not None and not callable(on_example):
            raise ValueError(f"HellaSwag.evaluate: on_example must be a function or None (got {on_example!r:.80})")
        correct = correct_norm = unscored = 0
        for i, ex in enumerate(self.examples, 1):
            if on_example is not None:
                on_example(i - 1, len(self.examples))
            sums, means = self.score(model, ex)
            if np.isnan(sums).any():
                unscored += 1
                continue
            correct += int(np.argmin(sums)) == ex["label"]
            correct_norm += int(np.argmin(means)) == ex["label"]
        if on_example is not None:
            on_example(len(self.examples), len(self.examples))
        return HellaSwagResult(len(self.examples), correct, correct_norm, unscored)
