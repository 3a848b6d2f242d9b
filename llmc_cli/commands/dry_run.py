"""`llmc train --dry-run`: the parameter count and the planned memory by component, from the model's config alone
(no weights read, nothing allocated), so it works for models this machine cannot hold."""

from __future__ import annotations

from rich.table import Table

from llmc_cli import registry
from llmc_cli.commands.console import DTYPES, backend_options, console, err_console, fail, one_line
from llmc_cli.formats.sources import load_config_any
from llmc_cli.kernels import BackendPlugin, BackendUnavailable
from llmc_cli.models.families import family_of, memory_plan
from llmc_cli.training.args import SHAPE_OPTIONS, TrainArgs, check_init_shape, check_seq_len, model_config


def dry_run(o: dict, args: TrainArgs, ranks: int) -> None:
    """Prints the plan of the run `args` describes on `ranks` ranks of --backend."""
    plugin, unusable = _check_backend_opt_names(o["backend"], o["backend_opt"])
    source = args.out if args.resume and args.out else args.init
    cfg = _planned_config(args, source)
    dtype = DTYPES[o["dtype"]] or registry.default_dtype(o["backend"])
    B, T = args.batch_size, args.seq_len
    try:
        check_seq_len(T, cfg)  # what training would refuse, refused here too
        plan = memory_plan(cfg, B, T, dtype, recompute=args.recompute, world_size=ranks, zero=args.zero,
                           overlap=args.overlap and ranks > 1)
    except ValueError as e:  # (TrainError too)
        fail(str(e))
    n = family_of(cfg).num_parameters(cfg)
    how = "" if args.recompute == "none" else f", --recompute {args.recompute}"
    per = f", per rank of {ranks} (--zero {args.zero})" if ranks > 1 else ""
    table = Table(title=f"{source or args.model}: {n:,} parameters, B={B} T={T}, {dtype}{how}{per}")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    heads = (B, T, cfg.n_head, family_of(cfg).kv_heads(cfg), cfg.n_embd // cfg.n_head)
    try:  # the backend's own library workspaces, as its options set them
        scratch = registry.planned_scratch(plugin, dtype, backend_options(o["backend_opt"]) or None,
                                           heads) if plugin else {}
    except BackendUnavailable as e:  # (PluginError too)
        fail(f"--backend {plugin.name}: {e}")
    plan |= {f"{plugin.name}: {k}": v for k, v in scratch.items()}
    for k, v in plan.items():
        table.add_row(k, f"{v / 2**30:.2f}")
    table.add_row("total", f"{sum(plan.values()) / 2**30:.2f}")
    console.print(table)
    if unusable:  # (after the plan: a bad option value above is still the one line of a refusal)
        err_console.print(f"note: --backend {o['backend']}: {unusable}; planned as on a machine where it runs",
                          markup=False, soft_wrap=True)


def _planned_config(args: TrainArgs, source: str | None):
    """The model's config: the checkpoint's (--resume, --init; its config alone, no weights read), else --model's
    preset with the shape options."""
    if not source:
        try:
            return model_config(args)
        except ValueError as e:
            fail(str(e))
    try:
        cfg = load_config_any(source)
        if not args.resume:
            check_init_shape(source, cfg, {k: getattr(args, k) for k in SHAPE_OPTIONS})
        return cfg
    except ValueError as e:  # (CheckpointError, TrainError)
        fail(str(e) if str(e).startswith("--init") else f"--{'resume' if args.resume else 'init'}: {e}")


def _check_backend_opt_names(backend: str, pairs) -> tuple[BackendPlugin | None, str | None]:
    """--dry-run opens no backend, so its --backend-opt are checked here as far as that allows: KEY=VALUE, each
    key once, and a key the backend declares (the values are the backend's planned_scratch checks). Returns the
    plugin the run would take, and why it cannot run here (None where it can); one that is not installed, or does
    not load, is one line (exit 2)."""
    opts = backend_options(pairs)
    try:
        plugin = registry.usable_plugin(backend)
    except BackendUnavailable as e:
        # a backend that is installed but cannot run here (no GPU on this laptop) is still planned for, where it
        # can; a name that is no backend, or one that does not load, has nothing to plan with
        plugin = registry.load_plugin(backend) if backend != "auto" else None
        if plugin is None:
            fail(f"--backend {backend}: {e}")
        unusable = one_line(e)
    else:
        unusable = None
    if opts:
        try:
            registry.check_option_names(plugin, opts)
        except BackendUnavailable as e:
            fail(f"--backend {plugin.name}: {e}")
    return plugin, unusable
