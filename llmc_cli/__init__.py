"""llmc: LLM training from scratch, llm.c style, with pluggable backends.

The Python API (docs/api.md) is what the commands use; the names below load on first use, so `import llmc_cli`
stays light:

    create_backend, discover            backends (llmc_cli.registry)
    TrainArgs, Trainer                  training (llmc_cli.training.args, llmc_cli.training.trainer)
    AdamWConfig                         the optimizer's settings (llmc_cli.optim)
    load_model, load_model_any          a model from any checkpoint (llmc_cli.inference.loading, formats.sources)
    tokenizer_for, load_tokenizer       the tokenizer a checkpoint was trained with (formats.sources, data.tokenizer)
    generate                            sampling (llmc_cli.inference.sampling)
    ValLoader, evaluate_loss, HellaSwag evaluation (llmc_cli.data.loader, llmc_cli.evals.evaluate)
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_API = {
    "create_backend": "llmc_cli.registry", "discover": "llmc_cli.registry",
    "TrainArgs": "llmc_cli.training.args", "Trainer": "llmc_cli.training.trainer",
    "AdamWConfig": "llmc_cli.optim",
    "load_model": "llmc_cli.inference.loading", "load_model_any": "llmc_cli.formats.sources",
    "tokenizer_for": "llmc_cli.formats.sources", "load_tokenizer": "llmc_cli.data.tokenizer",
    "generate": "llmc_cli.inference.sampling",
    "ValLoader": "llmc_cli.data.loader", "evaluate_loss": "llmc_cli.evals.evaluate", "HellaSwag": "llmc_cli.evals.evaluate",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'llmc_cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
