"""Hugging Face interop for GPT-2: a directory with config.json (GPT2LMHeadModel) and model.safetensors under
transformers' names, written and read here without the `safetensors` package or torch (the format lives in
checkpoint.py). Also what every family shares: sharded directories, recognising any model source (llm.c .bin,
run directory, Hugging Face directory of GPT-2 or Llama) and `llmc convert`.

transformers' GPT-2 uses Conv1D layers, whose weights are (in_features, out_features): the transpose of llm.c's
(OC, C). wte is stored with the real vocabulary (llm.c pads it to a multiple of 128 with zero rows) and the
language-model head is tied to it, so no lm_head.weight is written (one that is present is ignored on import).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import click
import numpy as np

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.checkpoint import ST_DTYPES, read_safetensors, read_safetensors_header, write_safetensors  # noqa: F401
from llmc_cli.data.loader import replace_dir
from llmc_cli.models.gpt2 import GPT2Config, num_parameters, parameter_shapes
from llmc_cli.models.base import split_flat

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


# ---- Hugging Face directories, any family: single-file or sharded safetensors under an index ------------------
def read_hf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a single-file or sharded (index.json) safetensors checkpoint, as float32."""
    path = Path(path)
    if (path / INDEX).is_file() and not (path / WEIGHTS).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ckpt.CheckpointError(f"{path / INDEX}: unreadable index ({type(e).__name__}: {e})") from None
        tensors: dict[str, np.ndarray] = {}
        for fname in sorted(set(weight_map.values())):
            if "/" in fname or "\\" in fname or not (path / fname).is_file():
                raise ckpt.CheckpointError(f"{path / INDEX} names shard {fname}, which is missing from {path}")
            tensors.update(read_safetensors(path / fname, {n for n, f in weight_map.items() if f == fname}))
        return tensors
    if not (path / WEIGHTS).is_file():
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
        hint = f" (found {', '.join(other)}: PyTorch pickles, which llmc does not read)" if other else ""
        raise ckpt.CheckpointError(f"{path}: no {WEIGHTS} or {INDEX}{hint}")
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
    ckpt.atomic_write_bytes(out / INDEX, [json.dumps(index, indent=2).encode()])


def read_config_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        c = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}/config.json: unreadable ({e})") from None
    if not isinstance(c, dict):
        raise ckpt.CheckpointError(f"{path}/config.json: expected a JSON object, got {type(c).__name__}")
    return c


HF_MODEL_TYPES = ("gpt2", "llama")
GPT2_HF_KEYS = {"block_size": "n_positions"}  # llmc's config field -> config.json's key, where they differ


def hf_field_names(e: Exception, keys: dict[str, str]) -> str:
    """A config error in config.json's own words: "n_positions must be ..." rather than llmc's "block_size"."""
    msg = str(e)
    for ours, theirs in keys.items():
        if msg.startswith(ours + " "):
            return theirs + msg[len(ours):]
    return msg


def hf_model_type(path: str | Path) -> str:
    """config.json's model_type, checked to be one llmc has a model for."""
    kind = read_config_json(path).get("model_type")
    if kind not in HF_MODEL_TYPES:
        raise ckpt.CheckpointError(f"{Path(path) / 'config.json'}: model_type {kind!r} is not supported "
                                   f"(llmc reads {' and '.join(HF_MODEL_TYPES)})")
    return kind


# ---- GPT-2 <-> transformers' names ----------------------------------------------------------------------------
def _layer_map(l: int) -> list[tuple[str, str, bool]]:
    """(llm.c tensor, HF name, transposed) for layer l."""
    h = f"transformer.h.{l}."
    return [("ln1w", h + "ln_1.weight", False), ("ln1b", h + "ln_1.bias", False),
            ("qkvw", h + "attn.c_attn.weight", True), ("qkvb", h + "attn.c_attn.bias", False),
            ("attprojw", h + "attn.c_proj.weight", True), ("attprojb", h + "attn.c_proj.bias", False),
            ("ln2w", h + "ln_2.weight", False), ("ln2b", h + "ln_2.bias", False),
            ("fcw", h + "mlp.c_fc.weight", True), ("fcb", h + "mlp.c_fc.bias", False),
            ("fcprojw", h + "mlp.c_proj.weight", True), ("fcprojb", h + "mlp.c_proj.bias", False)]


def to_hf_tensors(cfg: GPT2Config, params: np.ndarray) -> dict[str, np.ndarray]:
    p = split_flat(np.asarray(params, dtype=np.float32), parameter_shapes(cfg))
    t = {"transformer.wte.weight": p["wte"][:cfg.vocab_size], "transformer.wpe.weight": p["wpe"]}
    for l in range(cfg.n_layer):
        for ours, theirs, tr in _layer_map(l):
            t[theirs] = p[ours][l].T if tr else p[ours][l]
    t["transformer.ln_f.weight"], t["transformer.ln_f.bias"] = p["lnfw"], p["lnfb"]
    return t


def hf_config(cfg: GPT2Config, dtype: str = "float32") -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256, "use_cache": True,
        "torch_dtype": dtype,
    }


def export_hf(out_dir: str | Path, cfg: GPT2Config, params: np.ndarray, bf16: bool = False) -> Path:
    """Writes config.json + model.safetensors (F32, or BF16) into `out_dir` (created)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ckpt.CheckpointError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_hf_weights(out, to_hf_tensors(cfg, params), bf16)
    conf = json.dumps(hf_config(cfg, "bfloat16" if bf16 else "float32"), indent=2) + "\n"
    ckpt.atomic_write_bytes(out / "config.json", [conf.encode()])
    return out


def is_hf_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_hf_config(path: str | Path) -> GPT2Config:
    path = Path(path)
    c = read_config_json(path)
    if c.get("model_type") != "gpt2":
        raise ckpt.CheckpointError(f"{path}: config.json is for model_type {c.get('model_type')!r}, not a GPT-2 (gpt2)")
    try:
        cfg = GPT2Config(block_size=c["n_positions"], vocab_size=c["vocab_size"], n_layer=c["n_layer"],
                         n_head=c["n_head"], n_embd=c["n_embd"])
        cfg.validate()  # the fields' JSON types too: "12" or true is not a layer count
    except KeyError as e:
        raise ckpt.CheckpointError(f"{path}/config.json: bad GPT-2 config (no field {e})") from None
    except (TypeError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}/config.json: bad GPT-2 config ({hf_field_names(e, GPT2_HF_KEYS)})") from None
    inner = c.get("n_inner")
    if inner not in (None, 4 * cfg.n_embd):
        raise ckpt.CheckpointError(f"{path}: n_inner {inner} is not 4*n_embd, which llm.c's GPT-2 requires")
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise ckpt.CheckpointError(f"{path}: activation {act!r}; llmc's GPT-2 uses the tanh GELU (gelu_new)")
    return cfg


def import_hf(path: str | Path) -> tuple[GPT2Config, np.ndarray]:
    """(config, float32 parameters in llm.c's layout) from a Hugging Face GPT-2 directory."""
    path = Path(path)
    cfg = read_hf_config(path)
    tensors = {name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name: a
               for name, a in read_hf_tensors(path).items()}
    p = {n: np.zeros(s, np.float32) for n, s in parameter_shapes(cfg)}

    def get(name: str, shape: tuple) -> np.ndarray:
        a = tensors.get(name)
        if a is None:
            raise ckpt.CheckpointError(f"{path}: tensor {name} is missing")
        if a.shape != shape:
            raise ckpt.CheckpointError(f"{path}: tensor {name} has shape {a.shape}, config says {shape}")
        return a

    C, V = cfg.n_embd, cfg.vocab_size
    p["wte"][:V] = get("transformer.wte.weight", (V, C))
    p["wpe"][...] = get("transformer.wpe.weight", (cfg.block_size, C))
    shapes = dict(parameter_shapes(cfg))
    for l in range(cfg.n_layer):
        for ours, theirs, tr in _layer_map(l):
            s = shapes[ours][1:]
            p[ours][l] = get(theirs, s[::-1]).T if tr else get(theirs, s)
    p["lnfw"][...] = get("transformer.ln_f.weight", (C,))
    p["lnfb"][...] = get("transformer.ln_f.bias", (C,))
    flat = np.concatenate([p[n].reshape(-1) for n, _ in parameter_shapes(cfg)])
    assert flat.size == num_parameters(cfg)
    return cfg, flat


# ---- any model source -----------------------------------------------------------------------------------------
def load_model_any(path: str | Path) -> tuple[ckpt.ModelConfig, np.ndarray, str]:
    """(config, float32 params, kind) from a model file ("llmc": llm.c .bin or llmc's Llama model.safetensors),
    a run or step directory ("run") or a Hugging Face GPT-2 or Llama directory ("hf"), recognised by content.
    Raises CheckpointError with a one-line reason."""
    path = Path(path)
    if not path.exists():
        raise ckpt.CheckpointError(f"{path}: no such file or directory")
    try:
        if is_hf_dir(path):
            importer, _ = _hf_readers(path)
            cfg, params = importer(path)
            kind = "hf"
        else:
            cfg, params = ckpt.read_model_file(_resolve(path))
            kind = "llmc" if path.is_file() else "run"
    except OSError as e:  # no permission, a directory where a file belongs, an I/O error
        raise ckpt.CheckpointError(f"{e.filename or path}: cannot read it ({e.strerror or e})") from None
    ckpt.check_finite(path, params)
    return cfg, params, kind


def load_config_any(path: str | Path) -> ckpt.ModelConfig:
    """The model config alone (cheap: no parameters read)."""
    if is_hf_dir(path):
        _, read_config = _hf_readers(path)
        return read_config(path)
    return ckpt.read_model_file_config(_resolve(path))


def _hf_readers(path: Path):
    """(import_hf, read_hf_config) for a Hugging Face directory of this model_type: GPT-2's here, Llama's in
    llama3_hf."""
    if hf_model_type(path) == "llama":
        from llmc_cli.formats import hf_llama3 as llama3_hf
        return llama3_hf.import_hf, llama3_hf.read_hf_config
    return import_hf, read_hf_config


def tokenizer_for(path: str | Path) -> tuple[str, Path | None]:
    """(tokenizer name, its ranks file or None) that a model source was trained with: GPT-2's for llm.c files
    and GPT-2 directories; for Llama, what its run recorded (a from-scratch run on GPT-2 shards says "gpt2"),
    or a Hugging Face directory's tokenizer.model (Meta's tiktoken format). A Llama 3 tokenizer whose file is
    not there is an error naming the file expected."""
    path = Path(path)
    if is_hf_dir(path):
        if hf_model_type(path) == "gpt2" or read_config_json(path).get(LLMC_TOKENIZER_KEY) == "gpt2":
            return "gpt2", None
        where = [path]
    else:
        model_file = _resolve(path)
        name = ckpt.model_file_tokenizer(model_file)
        if name != "llama3":
            return name, None
        where = [model_file.parent, model_file.parent.parent]  # the step directory, then its run directory
    for d in where:
        if (d / ckpt.TOKENIZER_FILE).is_file():
            return "llama3", d / ckpt.TOKENIZER_FILE
    raise ckpt.CheckpointError(f"{path}: a Llama 3 model needs its tokenizer, {ckpt.TOKENIZER_FILE} (Meta's "
                               f"tiktoken-format ranks; tokenizer.json is not read), expected in "
                               f"{' or '.join(str(d) for d in where)}")


LLMC_TOKENIZER_KEY = "llmc_tokenizer"  # config.json of a Llama llmc trained with GPT-2's tokenizer says so


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir() and not (path / "latest").is_file() and not any((path / f).is_file() for f in ckpt.MODEL_FILES):
        raise ckpt.CheckpointError(f"{path}: not a run directory (no 'latest'), a step directory (no model.bin or "
                                   f"model.safetensors) or a Hugging Face directory (no config.json)")
    return ckpt.resolve_checkpoint(path)


def export_run(out_dir: str | Path, cfg, params: np.ndarray, bf16: bool = False, tokenizer: str = "gpt2",
               tokenizer_file: str | Path | None = None) -> Path:
    """A new run directory holding the model alone: step_00000000/<model file> and `latest` pointing at it
    (plus a Llama's tokenizer.model beside the steps). It samples, evaluates, converts and serves as --init like
    any run; resuming it says that it holds only a model (no optimizer state)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ckpt.CheckpointError(f"{out}: exists and is not an empty directory (--to run writes a new run)")
    step = out / ckpt.step_dir_name(0)
    step.mkdir(parents=True, exist_ok=True)
    if tokenizer_file is not None:
        ckpt.atomic_write_bytes(out / ckpt.TOKENIZER_FILE, [Path(tokenizer_file).read_bytes()])
    ckpt.write_model_file(step / ckpt.model_file_name(cfg), cfg, params, bf16=bf16, tokenizer=tokenizer)
    ckpt.atomic_write_bytes(out / "latest", [step.name.encode() + b"\n"])
    return out


# ---- llmc convert ---------------------------------------------------------------------------------------------
_HF_FILES = re.compile(r"config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                       r"model-\d{5}-of-\d{5}\.safetensors|tokenizer\.model")


def _is_llmc_output(path: Path) -> bool:
    """Is `path` something `llmc convert` itself writes: an llm.c model .bin, an llmc Llama .safetensors, or a
    Hugging Face model directory holding nothing but a model's files?"""
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        return "config.json" in names and all(_HF_FILES.fullmatch(n) and (path / n).is_file() for n in names)
    try:
        if path.suffix == ".bin":
            ckpt.read_model_header(path)
        else:
            ckpt.read_llama_header(path)
    except (ckpt.CheckpointError, OSError):
        return False
    return True


def check_destination(src: str | Path, dst: str | Path, force: bool) -> None:
    """`convert` writes a new destination; with `force` it may replace an earlier output of its own kind, but
    never the source, a data file or anything else of the user's, and never anything in a run directory."""
    from llmc_cli.formats.rundir import is_run_dir, step_folder_of
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise ckpt.CheckpointError(f"{dst} is the source itself; write the conversion somewhere else")
    if (step := step_folder_of(dst)) is not None:
        raise ckpt.CheckpointError(f"{dst} is inside the checkpoint {step}: llmc writes there only when training")
    if is_run_dir(dst) or (dst.parent.is_dir() and is_run_dir(dst.parent) and dst.name in ("latest", ".lock")):
        raise ckpt.CheckpointError(f"{dst} belongs to a run directory, not an empty directory: llmc writes there "
                                   "only when training")
    if not dst.exists() and not dst.is_symlink():
        return
    if not force:
        raise ckpt.CheckpointError(f"{dst} exists; llmc convert writes only new destinations (add --force to replace "
                                   f"an earlier conversion); nothing was changed")
    if not _is_llmc_output(dst):
        raise ckpt.CheckpointError(f"{dst} exists and is not an llmc model file or Hugging Face model directory, so "
                                   f"llmc will not replace it, even with --force; nothing was changed")


def _write_dir_atomically(dst: Path, write) -> None:
    """`write(tmp)` fills a temporary sibling directory, which then takes `dst`'s place (the old one is
    dropped only after the new one stands), so a failure leaves `dst` as it was."""
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        replace_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@click.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Precision of the written weights.")
@click.option("--to", "to", type=click.Choice(["auto", "run"]), default="auto", show_default=True,
              help="run = write DST as a new run directory (step_00000000/ holding the model, and 'latest'), "
                   "which --checkpoint and --init read; auto = by DST's name as described above.")
@click.option("--force", is_flag=True, help="Replace DST when it is an earlier llmc conversion (a model file or a "
                                            "Hugging Face model directory); anything else is never replaced.")
def convert(src: str, dst: str, dtype: str, to: str = "auto", force: bool = False) -> None:
    """Convert a GPT-2 or Llama 3 between llmc's files, a run directory (its latest checkpoint) and a Hugging
    Face directory. SRC is recognised by content. DST is an llm.c model file when it ends in .bin (GPT-2),
    llmc's Llama model file when it ends in .safetensors (usable with --checkpoint and --init), otherwise a
    Hugging Face directory (config.json + model.safetensors, sharded past 5 GiB; a Llama's tokenizer.model
    is copied along).

    \b
    Example:
      llmc convert checkpoints/shakespeare hf/shakespeare          # run dir -> Hugging Face
      llmc convert hf/shakespeare model.bin --dtype bf16           # Hugging Face -> llm.c (version 5)
      llmc convert hf/gpt2 checkpoints/gpt2 --to run                # Hugging Face -> run directory
      llmc convert hf/Llama-3.2-1B llama.safetensors               # Hugging Face Llama -> llmc
    """
    from llmc_cli.commands import console, fail
    try:
        check_destination(src, dst, force)
    except ckpt.CheckpointError as e:
        fail(f"DST: {e}")
    try:
        cfg, params, kind = load_model_any(src)
    except ckpt.CheckpointError as e:
        fail(f"SRC: {e}")
    llama = not isinstance(cfg, GPT2Config)
    tok_name, tok_file = "gpt2", None
    if llama:
        try:
            tok_name, tok_file = tokenizer_for(src)
        except ckpt.CheckpointError:  # a Llama 3 tokenizer that is not there: nothing to copy along
            tok_name = "llama3"
    bf16 = dtype == "bf16"
    d = Path(dst)
    try:
        if to == "run":
            export_run(d, cfg, params, bf16=bf16, tokenizer=tok_name, tokenizer_file=tok_file if llama else None)
            what = f"run directory ({ckpt.step_dir_name(0)}/{ckpt.model_file_name(cfg)}, latest; model only)"
        elif d.suffix in (".bin", ".safetensors"):
            if d.is_dir():
                fail(f"DST: {d} is a directory")
            if d.suffix == ".bin" and llama:
                fail(f"DST: {d}: llm.c's .bin holds GPT-2 only; write a Llama to a .safetensors file (llmc's "
                     f"format) or a directory (Hugging Face)")
            if d.suffix == ".safetensors" and not llama:
                fail(f"DST: {d}: write a GPT-2 to a .bin file (llm.c's format) or a directory (Hugging Face); "
                     f".safetensors files are llmc's Llama format")
            d.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_model_file(d, cfg, params, bf16=bf16, tokenizer=tok_name)
            what = (f"llm.c model file (version {ckpt.VERSION_BF16 if bf16 else ckpt.VERSION_FP32})" if not llama
                    else "llmc Llama model file")
        else:
            if d.exists() and not d.is_dir():
                fail(f"DST: {d} exists and is not a directory (name a model file with .bin or .safetensors)")
            if llama:
                from llmc_cli.formats.hf_llama3 import export_hf as export_llama
                _write_dir_atomically(d, lambda out: export_llama(out, cfg, params, bf16=bf16, tokenizer=tok_name,
                                                                  tokenizer_file=tok_file))
            else:
                _write_dir_atomically(d, lambda out: export_hf(out, cfg, params, bf16=bf16))
            what = "Hugging Face directory (config.json, model.safetensors)"
    except OSError as e:  # (the file that failed may be a temporary one beside DST: DST is what the user named)
        fail(f"DST: {d}: {e.strerror or e}")
    except ckpt.CheckpointError as e:
        fail(f"DST: {e}")
    console.print(f"{src} ({kind}, L={cfg.n_layer} NH={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size}) -> "
                  f"{dst}: {what}, {dtype}")
