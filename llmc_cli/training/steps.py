"""The forward and backward passes of one training step: its micro-steps over the staged batches, each next batch
copied ahead while one computes, replayed as captured graphs (CAP_GRAPHS) once GRAPH_AFTER steps ran uncaptured."""

from __future__ import annotations

from llmc_cli.models.base import STAGED
from llmc_cli.naming import arg

# uncaptured steps before the micro-steps are captured as graphs (CAP_GRAPHS): enough for every scratch buffer to
# reach its size and for a backend's own tuning of its products to settle (the CUDA backend's, d12: by step 5)
GRAPH_AFTER = 6


def micro_step(tr, i: int, dloss: float) -> None:
    """The kernels of Trainer `tr`'s micro-step i over the staged batch (gradients zeroed first at i = 0): all a
    captured graph holds, since nothing here moves data to or from the host."""
    model = tr.model
    if i == 0:
        model.zero_grad()
    model.forward(STAGED, STAGED, dloss=dloss)
    model.backward()
    tr.backend.loss_sum(tr.opt.loss_buf, model.acts["losses"], dloss, accumulate=i > 0)


def replays(tr, dloss: float) -> list | None:
    """The micro-steps as captured graphs (the first, and one for every later micro-step), captured once
    GRAPH_AFTER steps ran uncaptured (they size every scratch buffer and let the backend tune its kernels);
    None while not (yet) captured. A capture that fails turns graphs off for the run, with one line said."""
    if tr.graphs is None and tr.steps_run >= GRAPH_AFTER:
        try:
            cap = tr.backend.capture
            tr.graphs = [cap(lambda i=i: micro_step(tr, i, dloss)) for i in range(min(tr.grad_accum, 2))]
            tr.say(f"graphs: micro-steps replay captured graphs from step {tr.steps_run + 1} "
                   f"({arg('graphs', False)} to compare)")
        except Exception as e:  # the step runs uncaptured: nothing a failed capture recorded has run
            tr.graphs = False
            tr.say(f"graphs: off ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return tr.graphs or None


def forward_backward(tr, step: int) -> None:
    """Every micro-step of Trainer `tr`'s `step`. The loss, the norm and the skip verdict stay on the device until
    the update is queued (AdamW reads them there; data parallel reduces them there too), so the device never idles
    waiting for the host in a step."""
    model, accum = tr.model, tr.grad_accum
    dloss = 1.0 / (tr.a.batch_size * tr.a.seq_len * accum)
    graphs = replays(tr, dloss)
    tr.backend.begin_step()
    for i in range(accum):
        tr.feed.stage()
        if tr.phases and i == 0:
            tr.phases.mark("stage")
        if graphs:
            graphs[min(i, 1)]()
        else:
            # (only the last micro-step's backward makes gradients final; ZeRO-2 reduces every micro-step's)
            last = i == accum - 1 or getattr(tr.reducer, "every_micro_step", False)
            model.on_layer_grads = tr.reducer.layer_done if tr.reducer is not None and last else None
            micro_step(tr, i, dloss)
            model.on_layer_grads = None
        if i + 1 < accum or step + 1 < tr.a.steps:  # (the run's last batch has no batch after it)
            tr.feed.ahead()  # the next micro-step's batch (or the next step's) is copied while this one computes
