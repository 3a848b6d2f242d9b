"""The CUDA backend's options (--backend-opt) and their limits: read by the plugin before any device opens, by
the backend where it uses them, and by cuBLASLt's workspace plan; this module imports nothing heavy."""

from __future__ import annotations

from llmc_cli.kernels import ON_OFF, option_choice, option_flag, option_int

FP8_SCALINGS = ("current", "delayed")  # --backend-opt fp8_scaling=...
FP8_CLASSIFIER = ("off", "backward", "on")  # --backend-opt fp8_classifier=...: which of its products run in FP8
CUDNN_WORKSPACE_MAX_MIB = 1 << 20  # --backend-opt cudnn_workspace_mib: at most 1 TiB (past any GPU's memory)
# cudnn_workspace_mib unset: cuDNN's attention backward may take this share of the device's memory. 1/32 of an H200
# (4.4 GiB) holds Llama 3.1 8B's whole T=8192 sequence (4.1 GiB); run whole, the backward is 1.7x faster than over
# one-sequence slices (Llama 3.2-1B, B=8 T=2048; bench/attn_plans.py, docs/performance.md).
CUDNN_WORKSPACE_SHARE = 32
CUBLASLT_WORKSPACE_BYTES = 32 << 20  # every cuBLASLt matmul's workspace (cublaslt.py; here, where nothing is heavy)
# the on/off options and their environment variables (the older way to set them)
_FLAGS = (("cudnn", "LLMC_CUDNN"), ("epilogues", "LLMC_CUBLASLT_EPILOGUES"), ("tf32", "LLMC_TF32"),
          ("tune", "LLMC_CUBLASLT_TUNE"),
          ("fp8_fast_accum", "LLMC_FP8_FAST_ACCUM"), ("fp8_wgrad", "LLMC_FP8_WGRAD"), ("fp8_dgelu", "LLMC_FP8_DGELU"),
          ("fp8_fuse", "LLMC_FP8_FUSE"),
          ("p2p", "LLMC_P2P"), ("p2p_reduce", "LLMC_P2P_REDUCE"),
          ("p2p_copies", "LLMC_P2P_COPIES"))


def check_options(options: dict[str, str] | None) -> None:
    """Every option of this backend, and each one's environment variable, parsed before anything touches a
    device (the backend parses them again where it uses them): a bad value is BackendUnavailable naming it, even
    for an option the dtype leaves unused (tf32 under bf16, the fp8_* options under bf16 or fp32)."""
    for name, env in _FLAGS:
        option_flag(options, name, False, env=env)
    option_choice(options, "fp8_scaling", FP8_SCALINGS, "delayed", env="LLMC_FP8_SCALING")
    fp8_classifier(options)
    cudnn_workspace_cap(options)


def fp8_classifier(options: dict[str, str] | None) -> str:
    """Which of the classifier's products run in FP8 under --dtype fp8: none, the backward's two, or all three."""
    return option_choice(options, "fp8_classifier", FP8_CLASSIFIER, "off", env="LLMC_FP8_CLASSIFIER", aliases=ON_OFF)


def cudnn_workspace_cap(options: dict[str, str] | None) -> int | None:
    """cudnn_workspace_mib in bytes; None when unset (the backend then takes 1/CUDNN_WORKSPACE_SHARE of the
    device's memory)."""
    mib = option_int(options, "cudnn_workspace_mib", None, env="LLMC_CUDNN_WORKSPACE_MIB", max=CUDNN_WORKSPACE_MAX_MIB)
    return None if mib is None else mib << 20


def attention_backward_workspace(B: int, T: int, NH: int, NKV: int, hd: int) -> int:
    """Bytes of workspace cuDNN 9's deterministic attention backward asks for over B sequences (its sizes on Hopper,
    which the CUDA tests check against cuDNN): a bf16 score per query (T padded to 64) and key (padded to 128), a
    statistic per query, and with grouped-query attention a float32 copy of the query gradient."""
    rows = B * NH * T
    scores = 2 * B * NH * (-(-T // 64) * 64) * (-(-T // 128) * 128)
    return scores + 4 * rows + 256 + (4 * rows * hd if NKV < NH else 0)


def backward_slices(B: int, NKV: int):
    """(sequences, key/value heads) of the attention backward's slices, largest first, as the backend tries them
    against its workspace cap: the batch halved while it divides, then one sequence, then its key/value heads
    halved (each with its query heads)."""
    Bs, G = B, NKV
    while True:
        yield Bs, G
        if Bs % 2 == 0:
            Bs //= 2
        elif Bs > 1:
            Bs = 1
        elif G % 2 == 0:
            G //= 2
        else:
            return


def planned_attention_workspace(B: int, T: int, NH: int, NKV: int, hd: int, cap: int | None) -> int:
    """Bytes of the slice the backend runs within `cap` (None: the whole batch), else of the smallest."""
    rep = NH // NKV
    for Bs, G in backward_slices(B, NKV):
        need = attention_backward_workspace(Bs, T, G * rep, G, hd)
        if cap is None or need <= cap:
            break
    return need

