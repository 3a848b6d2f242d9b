"""Hugging Face interop for GPT-2: a directory with config.json (GPT2LMHeadModel) and model.safetensors under
transformers' names, written and read here without the `safetensors` package or torch.

safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (offsets
relative to the end of the header, which is space-padded to a multiple of 8), then the raw little-endian data.

transformers' GPT-2 uses Conv1D layers, whose weights are (in_features, out_features): the transpose of llm.c's
(OC, C). wte is stored with the real vocabulary (llm.c pads it to a multiple of 128 with zero rows) and the
language-model head is tied to it, so no lm_head.weight is written (one that is present is ignored on import).
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from . import checkpoint as ckpt
from .gpt2 import GPT2Config, num_parameters, parameter_shapes

ST_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


# ---- safetensors ----------------------------------------------------------------------------------------------
def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                      metadata: dict[str, str] | None = None) -> None:
    """float32 arrays -> one safetensors file in `dtype` (F32, or BF16 rounded to nearest even), atomically."""
    if dtype not in ("F32", "BF16"):
        raise ValueError(f"safetensors dtype {dtype} (F32 or BF16)")
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, off = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        raw = (ckpt.float32_to_bf16_bits(a).astype("<u2") if dtype == "BF16" else a.astype("<f4")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    ckpt.atomic_write_bytes(path, [np.uint64(len(h)).astype("<u8").tobytes(), h, *blobs])


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """(header dict, byte offset where the data starts)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ckpt.CheckpointError(f"{path}: too short for a safetensors file")
            n = int(np.frombuffer(head, "<u8")[0])
            if n > 100 * 2**20:
                raise ckpt.CheckpointError(f"{path}: header length {n} is implausible (not a safetensors file)")
            raw = f.read(n)
    except FileNotFoundError:
        raise ckpt.CheckpointError(f"{path}: no such file") from None
    try:
        header = json.loads(raw)
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise ckpt.CheckpointError(f"{path}: the header is not JSON (not a safetensors file)") from None
    return header, 8 + n


def read_safetensors(path: str | Path, names: set[str] | None = None) -> dict[str, np.ndarray]:
    """name -> float32 array (F32, BF16, F16), for every tensor or only those in `names`."""
    path = Path(path)
    header, start = read_safetensors_header(path)
    size = path.stat().st_size
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            if not isinstance(info, dict):
                raise ckpt.CheckpointError(f"{path}: tensor {name} has no dtype/shape/data_offsets entry")
            dt = ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
            if dt is None:
                raise ckpt.CheckpointError(f"{path}: tensor {name} has dtype {info.get('dtype')} "
                                           f"(supported: {', '.join(ST_DTYPES)})")
            offs, shape = info.get("data_offsets"), info.get("shape")
            if not (isinstance(offs, list) and len(offs) == 2 and isinstance(shape, list)
                    and all(type(v) is int and v >= 0 for v in offs + shape) and offs[0] <= offs[1]):
                raise ckpt.CheckpointError(f"{path}: tensor {name} has a bad shape {shape!r} or data_offsets "
                                           f"{offs!r} (non-negative integers expected)")
            b, e = offs
            shape = tuple(shape)
            if start + e > size or e - b != int(np.prod(shape, dtype=object)) * dt.itemsize:
                raise ckpt.CheckpointError(f"{path}: tensor {name} data out of bounds or of the wrong size")
            f.seek(start + b)
            a = np.frombuffer(f.read(e - b), dtype=dt).reshape(shape)
            out[name] = ckpt.bf16_bits_to_float32(a) if info["dtype"] == "BF16" else a.astype(np.float32)
    return out


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


def split(cfg: GPT2Config, params: np.ndarray) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for name, shape in parameter_shapes(cfg):
        n = int(np.prod(shape))
        out[name] = params[off:off + n].reshape(shape)
        off += n
    return out


def to_hf_tensors(cfg: GPT2Config, params: np.ndarray) -> dict[str, np.ndarray]:
    p = split(cfg, np.asarray(params, dtype=np.float32))
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
    write_safetensors(out / WEIGHTS, to_hf_tensors(cfg, params), "BF16" if bf16 else "F32",
                      {"format": "pt", "written_by": "llmc"})
    conf = json.dumps(hf_config(cfg, "bfloat16" if bf16 else "float32"), indent=2) + "\n"
    ckpt.atomic_write_bytes(out / "config.json", [conf.encode()])
    return out


def is_hf_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_hf_config(path: str | Path) -> GPT2Config:
    path = Path(path)
    try:
        c = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}/config.json: unreadable ({e})") from None
    if not isinstance(c, dict) or c.get("model_type") != "gpt2":
        kind = c.get("model_type") if isinstance(c, dict) else None
        raise ckpt.CheckpointError(f"{path}: config.json is for model_type {kind!r}, not a GPT-2 (gpt2)")
    try:
        cfg = GPT2Config(block_size=int(c["n_positions"]), vocab_size=int(c["vocab_size"]),
                         n_layer=int(c["n_layer"]), n_head=int(c["n_head"]), n_embd=int(c["n_embd"]))
        cfg.validate()
    except (KeyError, TypeError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}/config.json: bad GPT-2 config ({e})") from None
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
    files = [path / WEIGHTS]
    if not files[0].is_file():
        if (path / INDEX).is_file():
            try:
                wmap = json.loads((path / INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ckpt.CheckpointError(f"{path / INDEX}: unreadable ({e})") from None
            files = [path / f for f in sorted(set(wmap.values()))]
        else:
            other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
            hint = f" (found {', '.join(other)}: PyTorch pickles, which llmc does not read)" if other else ""
            raise ckpt.CheckpointError(f"{path}: no {WEIGHTS}{hint}")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        for name, a in read_safetensors(f).items():
            tensors[name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name] = a
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
def load_model_any(path: str | Path) -> tuple[GPT2Config, np.ndarray, str]:
    """(config, float32 params, kind) from an llm.c .bin ("llmc"), a run or step directory ("run") or a Hugging
    Face directory ("hf"), recognised by content. Raises CheckpointError with a one-line reason."""
    path = Path(path)
    if not path.exists():
        raise ckpt.CheckpointError(f"{path}: no such file or directory")
    if is_hf_dir(path):
        cfg, params = import_hf(path)
        return cfg, params, "hf"
    model_bin = _resolve(path)
    cfg, params, _ = ckpt.read_model(model_bin)
    return cfg, params, ("llmc" if path.is_file() else "run")


def load_config_any(path: str | Path) -> GPT2Config:
    """The model config alone (cheap: no parameters read)."""
    if is_hf_dir(path):
        return read_hf_config(path)
    cfg, _ = ckpt.read_model_header(_resolve(path))
    return cfg


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir() and not (path / "latest").is_file() and not (path / "model.bin").is_file():
        raise ckpt.CheckpointError(f"{path}: not a run directory (no 'latest'), a step directory (no model.bin) "
                                   f"or a Hugging Face directory (no config.json)")
    return ckpt.resolve_checkpoint(path)


# ---- llmc convert ---------------------------------------------------------------------------------------------
@click.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Precision of the written weights.")
def convert(src: str, dst: str, dtype: str) -> None:
    """Convert a GPT-2 between an llm.c .bin, a run directory (its latest checkpoint) and a Hugging Face
    directory. SRC is recognised by content; DST is an llm.c model file when it ends in .bin, otherwise a
    Hugging Face directory (config.json + model.safetensors).

    \b
    Example:
      llmc convert checkpoints/shakespeare hf/shakespeare          # run dir -> Hugging Face
      llmc convert hf/shakespeare model.bin --dtype bf16           # Hugging Face -> llm.c (version 5)
    """
    from .cli import console, fail
    try:
        cfg, params, kind = load_model_any(src)
    except ckpt.CheckpointError as e:
        fail(f"SRC: {e}")
    bf16 = dtype == "bf16"
    d = Path(dst)
    try:
        if d.suffix == ".bin":
            if d.is_dir():
                fail(f"DST: {d} is a directory")
            d.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_model(d, cfg, params, bf16=bf16)
            what = f"llm.c model file (version {ckpt.VERSION_BF16 if bf16 else ckpt.VERSION_FP32})"
        else:
            if d.exists() and not d.is_dir():
                fail(f"DST: {d} exists and is not a directory (name an llm.c file with .bin)")
            export_hf(d, cfg, params, bf16=bf16)
            what = "Hugging Face directory (config.json, model.safetensors)"
    except (OSError, ckpt.CheckpointError) as e:
        fail(f"DST: {e}")
    console.print(f"{src} ({kind}, L={cfg.n_layer} NH={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size}) -> "
                  f"{dst}: {what}, {dtype}")
