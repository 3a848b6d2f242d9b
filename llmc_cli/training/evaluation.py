"""What rank 0 looks at between training steps: the validation loss, HellaSwag, and a sample of text."""

from __future__ import annotations

from llmc_cli.evals.evaluate import HellaSwag, eval_batches
from llmc_cli.inference.sampling import NonFiniteLogits, generate


def evaluate_before(tr, step: int, last: bool) -> dict | None:
    """Before Trainer `tr`'s iteration `step` trains: validation, HellaSwag and a sample where due, each said in a
    line (rank 0 only); the record of the scores (None: no score)."""
    a, rec = tr.a, None
    if tr.comm.rank != 0:
        return None
    validates, evaluates, samples = tr.votes.evals_before(step, last)
    if validates:
        rec = {"step": step, "val_loss": tr.validate()}
        n = eval_batches(tr.val_loader, a.val_batches)
        tr.say(f"step {step}: val loss {rec['val_loss']:.6f} ({n} batches of B={a.batch_size} T={a.seq_len})")
    if evaluates:
        if tr.hellaswag is None:  # (the eval file is read on first use)
            tr.hellaswag = HellaSwag(a.hellaswag)
        rec = (rec or {"step": step}) | tr.hellaswag.evaluate(tr.model).as_dict()
        tr.say(f"step {step}: HellaSwag acc_norm {rec['hellaswag_acc_norm']:.4f} "
               f"acc {rec['hellaswag_acc']:.4f} ({rec['hellaswag_examples']} examples)")
    if samples:
        text = sample_text(tr)
        if text:
            tr.say(f"sample at step {step}:\n{text}\n---")
    return rec


def sample_text(tr) -> str:
    """Up to --sample-tokens of text from Trainer `tr`'s model ('' without a decoder), cut short by a stop request:
    only rank 0 samples, so no rank waits on it, and a scheduler's grace is not spent on a long sample."""
    if tr.decode is None or tr.eot is None:
        return ""
    if tr.sampler is None:
        window = min(tr.cfg.block_size, max(tr.a.seq_len, 64))
        tr.sampler = tr.family.model_class(tr.cfg, tr.backend, 1, window, training=False, share_params=tr.model)
    ids = []
    try:
        for t in generate(tr.sampler, tr.sample_prompt or [tr.eot], tr.a.sample_tokens, tr.rng, temperature=1.0,
                          stop_token=tr.eot):
            ids.append(t)
            if tr.stop_requested():
                break
    except NonFiniteLogits as e:  # a sample is a look at the run, not a reason to end it (the guard judges steps)
        return f"{tr.decode(ids)}[no more sample: {e}]"
    return tr.decode(ids)
