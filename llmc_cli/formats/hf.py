"""Hugging Face model directories, any family: config.json, and model.safetensors or shards under an index,
read and written without the `safetensors` package or torch (the format itself is in safetensors.py). Each
family's names and config keys are in hf_gpt2.py and hf_llama3.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from llmc_cli.formats.files import CheckpointError, atomic_write_bytes, read_at_most
from llmc_cli.formats.safetensors import read_safetensors, write_safetensors

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.model"  # Meta's tiktoken-format Llama 3 ranks, as Hugging Face directories hold it
LLMC_TOKENIZER_KEY = "llmc_tokenizer"  # config.json of a Llama llmc trained with GPT-2's tokenizer says so


# ---- Hugging Face directories, any family: single-file or sharded safetensors under an index ------------------
def check_layer_count(path: str | Path, names, pattern: str, key: str, n_layer: int) -> None:
    """Weights of a layer past config.json's count (`pattern` matches a tensor name, its group 1 the layer) are
    refused: the import would drop them without a word and make a shallower model."""
    # the numbers as digits, compared by length first: int() refuses more than 4300 of them (a damaged name)
    found = sorted({m.group(1).lstrip("0") or "0" for n in names if (m := re.match(pattern, n))},
                   key=lambda s: (len(s), s))
    if extra := [s for s in found if len(s) > 18 or int(s) >= n_layer]:
        short = lambda s: s if len(s) <= 20 else s[:20] + "..."  # noqa: E731
        raise CheckpointError(f"{path}: holds weights of layer {short(extra[0])} (layers 0..{short(found[-1])} in "
                              f"all) but config.json says {key} = {n_layer}; correct config.json")


def read_hf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a single-file or sharded (index.json) safetensors checkpoint, as float32."""
    path = Path(path)
    if (path / INDEX).is_file() and not (path / WEIGHTS).is_file():
        try:
            weight_map = _read_json(path / INDEX)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{path / INDEX}: unreadable index ({type(e).__name__}: {e})") from None
        tensors: dict[str, np.ndarray] = {}
        for fname in sorted(set(weight_map.values())):
            if "/" in fname or "\\" in fname or not (path / fname).is_file():
                raise CheckpointError(f"{path / INDEX} names shard {fname}, which is missing from {path}")
            tensors.update(read_safetensors(path / fname, {n for n, f in weight_map.items() if f == fname}))
        return tensors
    if not (path / WEIGHTS).is_file():
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
        hint = f" (found {', '.join(other)}: PyTorch pickles, which llmc does not read)" if other else ""
        raise CheckpointError(f"{path}: no {WEIGHTS} or {INDEX}{hint}")
    return read_safetensors(path / WEIGHTS)


def write_hf_weights(out: Path, tensors: dict[str, np.ndarray], bf16: bool = False,
                     max_shard_bytes: int = 5 * 2**30) -> None:
    """The weights as transformers' save_pretrained lays them out: one model.safetensors, or shards of at most
    `max_shard_bytes` (model-00001-of-00003.safetensors) and an index when they do not fit one."""
    itemsize = 2 if bf16 else 4
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        nbytes = a.size * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += nbytes
    dtype, meta = ("BF16" if bf16 else "F32"), {"format": "pt", "written_by": "llmc"}
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX]:  # a previous export's other shard count
        if stale.exists():
            stale.unlink()
    if len(shards) == 1:
        write_safetensors(out / WEIGHTS, shards[0], dtype, meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, shard, dtype, meta)
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": sum(a.size * itemsize for a in tensors.values())}, "weight_map": weight_map}
    atomic_write_bytes(out / INDEX, [json.dumps(index, indent=2).encode()])


JSON_MAX_BYTES = 64 * 2**20  # config.json and the shards' index are kilobytes; never read a whole stray big file


def _read_json(path: Path):
    raw = read_at_most(path, JSON_MAX_BYTES)
    if raw is None:
        raise ValueError(f"larger than {JSON_MAX_BYTES // 2**20} MiB, not a Hugging Face JSON file")
    return json.loads(raw)


def read_config_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        c = _read_json(path / "config.json")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: unreadable ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}/config.json: unreadable (JSON nested too deeply)") from None
    if not isinstance(c, dict):
        raise CheckpointError(f"{path}/config.json: expected a JSON object, got {type(c).__name__}")
    return c


HF_MODEL_TYPES = ("gpt2", "llama")
# llmc's config field (or the option its check names) -> config.json's key, where they differ
GPT2_HF_KEYS = {"block_size": "n_positions", "--n-embd": "n_embd", "--n-head": "n_head"}


def hf_field_names(e: Exception, keys: dict[str, str]) -> str:
    """A config error in config.json's own words: "n_positions must be ..." rather than llmc's "block_size", every
    field it names (a check on two fields names both), in one pass so a name is never translated twice."""
    if not keys:
        return str(e)
    names = "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({names})(?![\w-])", lambda m: keys[m.group(1)], str(e))


def hf_model_type(path: str | Path) -> str:
    """config.json's model_type, checked to be one llmc has a model for."""
    kind = read_config_json(path).get("model_type")
    if kind not in HF_MODEL_TYPES:
        raise CheckpointError(f"{Path(path) / 'config.json'}: model_type {kind!r} is not supported "
                                   f"(llmc reads {' and '.join(HF_MODEL_TYPES)})")
    return kind


def is_hf_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()

