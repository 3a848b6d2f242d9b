"""The CUDA backend's options (--backend-opt) and their limits: read by the plugin before any device opens, by
the backend where it uses them, and by cuBLASLt's workspace plan; this module imports nothing heavy."""

from __future__ import annotations

from llmc_cli.kernels import option_choice, option_flag, option_int

FP8_SCALINGS = ("current", "delayed")  # --backend-opt fp8_scaling=...
CUDNN_WORKSPACE_MAX_MIB = 1 << 20  # --backend-opt cudnn_workspace_mib: at most 1 TiB (past any GPU's memory)
CUBLASLT_WORKSPACE_BYTES = 32 << 20  # every cuBLASLt matmul's workspace (cublaslt.py; here, where nothing is heavy)
# the on/off options and their environment variables (the older way to set them)
_FLAGS = (("cudnn", "LLMC_CUDNN"), ("epilogues", "LLMC_CUBLASLT_EPILOGUES"), ("tf32", "LLMC_TF32"),
          ("tune", "LLMC_CUBLASLT_TUNE"), ("fp8_classifier", "LLMC_FP8_CLASSIFIER"),
          ("fp8_fast_accum", "LLMC_FP8_FAST_ACCUM"), ("fp8_wgrad", "LLMC_FP8_WGRAD"), ("fp8_dgelu", "LLMC_FP8_DGELU"),
          ("p2p", "LLMC_P2P"), ("p2p_reduce", "LLMC_P2P_REDUCE"),
          ("p2p_copies", "LLMC_P2P_COPIES"))


def check_options(options: dict[str, str] | None) -> None:
    """Every option of this backend, and each one's environment variable, parsed before anything touches a
    device (the backend parses them again where it uses them): a bad value is BackendUnavailable naming it, even
    for an option the dtype leaves unused (tf32 under bf16, the fp8_* options under bf16 or fp32)."""
    for name, env in _FLAGS:
        option_flag(options, name, False, env=env)
    option_choice(options, "fp8_scaling", FP8_SCALINGS, "delayed", env="LLMC_FP8_SCALING")
    option_int(options, "cudnn_workspace_mib", 512, env="LLMC_CUDNN_WORKSPACE_MIB", max=CUDNN_WORKSPACE_MAX_MIB)
