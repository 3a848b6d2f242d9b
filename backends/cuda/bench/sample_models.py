"""Run directories of random weights for timing `llmc sample` (speed does not depend on the weights): one per
--model preset, bf16, a Llama with a tokenizer.model of Meta's size (128,000 tiktoken ranks, so that the command
samples over all 128,256 ids as it does for the real model; the ranks are byte strings, not Meta's).
    python backends/cuda/bench/sample_models.py DIR MODEL [MODEL ...]     -> DIR/MODEL, skipped where it exists"""

from __future__ import annotations

import base64
import itertools
import sys
from pathlib import Path

from llmc_cli.formats.sources import export_run
from llmc_cli.models.families import family_for

LLAMA3_RANKS = 128_000


def write_ranks(path: Path, n: int) -> None:
    """n distinct byte strings, shortest first (the 256 single bytes, then pairs, then triples)."""
    pieces = itertools.chain.from_iterable(itertools.product(range(256), repeat=k) for k in (1, 2, 3))
    path.write_text("".join(f"{base64.b64encode(bytes(p)).decode()} {i}\n"
                            for i, p in zip(range(n), pieces)))


def main(root: str, models: list[str]) -> None:
    root_dir = Path(root)
    root_dir.mkdir(parents=True, exist_ok=True)
    for name in models:
        out = root_dir / name
        if out.exists():
            continue
        fam = family_for(name)
        cfg = fam.preset(name)
        params = fam.init_parameters(cfg, 0)
        if fam.name == "gpt2":
            export_run(out, cfg, params, bf16=True)
        else:
            ranks = root_dir / "tokenizer.model"
            write_ranks(ranks, LLAMA3_RANKS)
            export_run(out, cfg, params, bf16=True, tokenizer="llama3", tokenizer_file=ranks)
        print(f"{out}: {cfg}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
