"""The CUDA backend's FP8 matmuls (--dtype fp8): the casts in front of cuBLASLt's FP8 products, delayed scaling's
tensors ("sites") and their amax histories, the producers that write a product's FP8 operand themselves, and the
three products of a linear layer on FP8 operands. A part of CudaBackend (backend.py), whose kernels, scratch,
stream and cuBLASLt plans it uses; the FP8 kernels are in kernels.cu's FP8 section."""

from __future__ import annotations

from collections import Counter

import cupy as cp
import numpy as np

from llmc_cli.kernels import option_choice

from .options import FP8_SCALINGS

FP8_HISTORY = 16  # steps of amax a delayed scale looks back over (torchao's default length)
FP8_SITES = 1024  # tensors delayed scaling follows (3 per layer matmul); any beyond cast with current scaling
_CAST_BLOCK = 256  # threads a block of the casts and the dequantize kernel


class Fp8Matmuls:
    """CudaBackend's FP8 side: its matmul_forward and matmul_backward call _fp8_forward and _fp8_backward (and the
    variants below) where _fp8_serves; producers call _fp8_producer."""

    # Each product casts the operands no producer wrote (below) just before it runs: x and w to e4m3, dout to
    # e5m2, each tensor with its own scale (kernels.cu's FP8 section), into scratch that every matmul shares. The
    # backward products take transposed copies (Hopper's FP8 matmuls are "TN" only) made by the same cast.
    # Delayed scaling (the default; measured faster, and as good, in docs/performance.md) scales by the largest
    # amax of the tensor's last FP8_HISTORY steps and records this one's in the cast itself: one pass. Current
    # scaling (fp8_scaling=current) scales by the tensor's amax now: a pass to find it, then the cast. Delayed
    # scaling's tensors ("sites") are named by the weight they meet and their role (x, w, dout), numbered in order
    # of first use, which the training step fixes (forward layer by layer, then backward), so a checkpoint's
    # histories find their tensors again (carried_state). A site's first step, with no history, scales currently.

    def _init_fp8_scaling(self, options: dict[str, str] | None) -> None:
        """FP8's scales: per matmul call's cast tensors, and (delayed scaling) each tensor's amax history."""
        self.fp8_scaling = option_choice(options, "fp8_scaling", FP8_SCALINGS, "delayed", env="LLMC_FP8_SCALING")
        delayed = self.fp8 and self.fp8_scaling == "delayed"
        # (zeroed on the backend's stream: a memset on CuPy's default stream is not ordered before the work of this
        # non-blocking one, and could land after load_carried_state's upload of the histories)
        with self.stream:
            # amax (uint32 bits) and inverse scale (float32) of the <= 3 tensors one matmul call casts: x, w, dout.
            # Fixed addresses, so cuBLASLt plans hold them and a captured graph replays them; each scale 256-byte
            # aligned (cuBLASLt refuses to run a 4-byte aligned scale pointer, though its heuristic accepts it).
            self._fp8_slots = cp.zeros(256, dtype=np.uint32) if self.fp8 else None
            # delayed scaling: row 0 the step's amax so far, rows 1..FP8_HISTORY the earlier steps' (newest first),
            # one column a tensor ("site"); float32 for the ranks' MAX all-reduce, read as bits by the kernels
            self._fp8_hist = cp.zeros((FP8_HISTORY + 1) * FP8_SITES, dtype=np.float32) if delayed else None
            # a producer's inverse scale per site, 256-byte aligned as the slots' (read by the product it feeds)
            self._fp8_site_inv = cp.zeros(64 * FP8_SITES, dtype=np.float32) if delayed else None
        self._fp8_sites: dict[tuple[int, str], int] = {}  # (weight pointer, role) -> site, in order of first use
        self._fp8_next_site = 0  # the next site's number
        self._fp8_fresh: set[int] = set()  # sites with no history yet: no step ended since they were first cast
        self._fp8_loaded = 0  # sites below this number have a history from a checkpoint (load_carried_state)
        # each site's tensor, "role OCxC" ("x 3072x768"), by number: a checkpoint keeps them beside the histories, so
        # a resumed run sees which history is whose; and the checkpoint's (None: it has none)
        self._fp8_names: list[str] = []
        self._fp8_loaded_names: list[str] | None = None
        # the classifier's weight cast transposed for its input gradient: its chunks all multiply the same weight
        # within a training step (updated after them), so it is cast once a step: (weight pointer, step) it holds
        self._fp8_head_of: tuple[int, int] | None = None
        self._fp8_step = 0  # the training step under way (its number), 0 between steps, where nothing is kept
        self._fp8_steps = 0  # training steps begun
        # (pointer, elements) of a buffer -> (site, e5m2, address) of the FP8 bytes a producer wrote for it: over
        # its first bytes, or (the fused classifier's) in scratch. A buffer, not its memory: the engine may place
        # another buffer over the same memory once the product has read it (GPT-2's shared GELU output inside the
        # logits), and that one holds act
        self._fp8_held: dict[tuple[int, int], tuple[int, bool, int]] = {}
        # producer calls that wrote FP8, by role, the classifier's apart (a replayed graph's are not counted)
        self.fp8_produced: Counter[str] = Counter()

    def _fp8_serves(self, N, C, OC, precise, *bufs, backward=False) -> bool:
        """FP8 for this product: dims multiples of 16 (cuBLASLt's FP8 rule), more rows than the GEMV path
        takes, 16-byte aligned operands, and not a `precise` product (the classifier's) unless fp8_classifier
        names its direction."""
        head = self.fp8_classifier == "on" or (backward and self.fp8_classifier == "backward")
        return (self.fp8 and (not precise or head) and N > self.GEMV_MAX_N and N % 16 == 0
                and C % 16 == 0 and OC % 16 == 0 and self._aligned(*bufs))

    def _fp8_slot(self, i):
        """(amax pointer, inverse-scale pointer) of slot i (0 = x, 1 = w, 2 = dout)."""
        base = self._fp8_slots.data.ptr
        return base + 4 * i, base + 256 * (i + 1)

    def _fp8_site(self, weight, role: str) -> int | None:
        """The delayed-scaling site of (weight, role), numbered on first use; None under current scaling or once
        FP8_SITES are taken."""
        if self._fp8_hist is None:
            return None
        key = (weight.data.ptr, role)
        site = self._fp8_sites.get(key)
        if site is None and self._fp8_next_site < FP8_SITES:
            site = self._fp8_sites[key] = self._fp8_next_site
            self._fp8_next_site += 1
            self._fp8_names.append(f"{role} {'x'.join(str(d) for d in weight.shape)}")
            # another tensor than the checkpoint's at this number: the model's sites changed since it was saved, and
            # this history and the later ones (numbered in order) would scale their neighbours' tensors
            loaded = self._fp8_loaded_names
            if site < self._fp8_loaded and loaded is not None and loaded[site] != self._fp8_names[site]:
                self._fp8_drop_loaded(site)
            if site >= self._fp8_loaded:
                self._fp8_fresh.add(site)
        return site

    def _fp8_drop_loaded(self, site: int) -> None:
        """Drops the checkpoint's histories of `site` and the later sites: they start fresh, as in a new run."""
        with self.stream:  # (ordered after load_carried_state's upload and before this step's casts)
            self._fp8_hist.reshape(FP8_HISTORY + 1, FP8_SITES)[1:, site:] = 0
        self._fp8_loaded = site

    def _fp8_history(self, site: int) -> tuple:
        """(amax history, its length, stride, this step's amax) of a site: the scale's arguments of every cast
        and producer kernel under delayed scaling."""
        base = self._fp8_hist.data.ptr
        return base + 4 * (FP8_SITES + site), FP8_HISTORY, FP8_SITES, base + 4 * site

    def _fp8_forget(self, ptr: int, nbytes: int) -> None:
        """A new buffer at [ptr, ptr + nbytes): weights that lived there were freed, and their sites' histories
        must not scale whatever is multiplied there next (tests, benchmarks: models made one after another)."""
        for key in [k for k in self._fp8_sites if ptr <= k[0] < ptr + nbytes]:
            del self._fp8_sites[key]  # (its number is not given out again; carried_state keeps numbering alike)
        for key in [k for k in self._fp8_held if ptr <= k[0] < ptr + nbytes]:
            del self._fp8_held[key]
        if self._fp8_head_of and ptr <= self._fp8_head_of[0] < ptr + nbytes:
            self._fp8_head_of = None

    def _fp8_cast(self, src, slot, rows, cols, out=None, out_t=None, e5m2=False, site=None, sums=False):
        """src -> out (rows, cols) and/or out_t (cols, rows) in FP8, its inverse scale into `slot`: scaled by the
        history of `site` (delayed scaling), else by its own amax found first (into the site's step amax, or the
        slot's). With out_t and `sums`, src's column sums per 64 rows are taken on the way, for _fp8_add_sums."""
        amax, inv = self._fp8_slot(slot)
        n = rows * cols
        hist_n, stride, observe = 1, 0, 0
        if site is not None:
            if site not in self._fp8_fresh:
                amax, hist_n, stride, observe = self._fp8_history(site)
            else:
                amax = self._fp8_hist.data.ptr + 4 * site  # (the step's amax so far: at least this tensor's)
        if observe == 0:
            self._launch(self._k("fp8_amax", True), self._grid(n, 8), _CAST_BLOCK, (np.uint64(amax), src, np.int64(n)))
        scale = (np.uint64(inv), np.uint64(amax), np.int32(hist_n), np.int32(stride), np.uint64(observe), src)
        if out_t is None:
            self._launch(self._k("fp8_quantize", True), self._grid(n, 8), _CAST_BLOCK,
                         (out, *scale, np.int64(n), np.int32(e5m2)))
        else:
            tiles = (rows + 63) // 64
            part = self.scratch("colsum", tiles * cols) if sums else np.uint64(0)
            self._launch(self._k("fp8_quantize_t", True), ((cols + 63) // 64, tiles), 256,
                         (out if out is not None else np.uint64(0), out_t, *scale, np.int32(rows), np.int32(cols),
                          np.int32(e5m2), part))

    def _fp8_add_sums(self, dbias, rows, cols):
        """dbias += the column sums the last cast with `sums` took (the backward's bias gradient, GPT-2)."""
        tiles = (rows + 63) // 64
        self._launch(self._kk("column_sums_reduce", dbias), (cols + 255) // 256, 256,
                     (dbias, self.scratch("colsum", tiles * cols), np.int32(tiles), np.int32(cols)))

    # the training step's boundaries (Backend.begin_step etc.): only delayed scaling carries anything
    def begin_step(self) -> None:
        self._fp8_steps += 1
        self._fp8_step = self._fp8_steps
        if self._fp8_hist is not None:
            cp.cuda.runtime.memsetAsync(self._fp8_hist.data.ptr, 0, 4 * FP8_SITES, self.stream.ptr)

    def step_observations(self):
        return None if self._fp8_hist is None else self._fp8_hist[:FP8_SITES]

    def end_step(self) -> None:
        self._fp8_step = 0
        if self._fp8_hist is not None:
            self._launch(self._k("fp8_roll", True), FP8_SITES // 256, 256,
                         (self._fp8_hist, np.int32(FP8_SITES), np.int32(FP8_HISTORY)))
            self._fp8_fresh.clear()

    def carried_state(self) -> dict:
        # (the fresh sites are the newest: the ones below have a history)
        known = max(self._fp8_loaded, self._fp8_next_site - len(self._fp8_fresh)) if self._fp8_hist is not None else 0
        if not known:
            return {}
        with self.stream:
            h = cp.asnumpy(self._fp8_hist, stream=self.stream).reshape(FP8_HISTORY + 1, FP8_SITES)
        self.stream.synchronize()
        state = {"fp8_amax_history": [[float(v) for v in h[1:, site]] for site in range(known)]}
        # (the loaded names of the sites this run has not cast yet; a checkpoint without names leaves them unknown)
        names = self._fp8_names[:known] + (self._fp8_loaded_names or [])[len(self._fp8_names):known]
        if len(names) == known:
            state["fp8_sites"] = names
        return state

    def load_carried_state(self, state: dict) -> None:
        rows = state.get("fp8_amax_history") if isinstance(state, dict) else None
        if self._fp8_hist is None or rows is None:
            return
        if (not isinstance(rows, list) or len(rows) > FP8_SITES
                or not all(isinstance(r, list) and len(r) == FP8_HISTORY for r in rows)):
            raise ValueError(f"fp8_amax_history: expected at most {FP8_SITES} lists of {FP8_HISTORY} amax values")
        try:
            h = np.asarray(rows, dtype=np.float64).reshape(len(rows), FP8_HISTORY)
        except (TypeError, ValueError):
            raise ValueError("fp8_amax_history: expected numbers") from None
        if not (np.isfinite(h).all() and (h >= 0).all() and (h <= np.finfo(np.float32).max).all()):
            raise ValueError("fp8_amax_history: expected finite amax values >= 0")
        names = state.get("fp8_sites")
        if "fp8_sites" in state and not (isinstance(names, list) and len(names) == len(rows)
                                         and all(isinstance(n, str) for n in names)):
            raise ValueError(f"fp8_sites: expected a list of {len(rows)} tensor names (strings), one per amax history")
        full = np.zeros((FP8_HISTORY + 1, FP8_SITES), np.float32)
        full[1:, :len(rows)] = h.T
        self.upload(self._fp8_hist, full.reshape(-1))
        self._fp8_sites.clear()  # (sites are numbered again, in the same order, as the steps first cast them)
        self._fp8_held.clear()
        self._fp8_next_site, self._fp8_fresh, self._fp8_loaded = 0, set(), len(rows)
        self._fp8_names, self._fp8_loaded_names = [], None if names is None else list(names)

    def _fp8_zero(self):
        cp.cuda.runtime.memsetAsync(self._fp8_slots.data.ptr, 0, 16, self.stream.ptr)

    def _fp8_arena(self, *sizes):
        """Views of one scratch buffer (the largest request of any call; models.families.fp8_cast_bytes)."""
        a = self._transient(sum(sizes))
        out, at = [], 0
        for n in sizes:
            out.append(a[at:at + n])
            at += n
        return out

    # Producers (fp8_next; kernels.cu's FP8 section): a kernel whose output the product with `weight` reads next
    # writes that operand in FP8 itself, over the first bytes of its own output buffer, where the scale is known
    # before the tensor exists (delayed scaling, a site with a history). The product then reads it in place, and
    # its backward transposes it into the buffer's second half (an FP8 copy takes half of act's bytes). The bytes
    # and scales are those the product's own cast would have made, so either way trains the same bits.
    def _fp8_producer(self, out, weight, role: str, able: bool = True, head: bool = False):
        """The FP8 output arguments (out8, inv8, amax8, hist_n, stride, observe8) for a kernel writing `out`, which
        the product with `weight` reads next as its `role` operand ("x" its input, "dout" its gradient), where
        the kernel is `able` and the product runs in FP8 from a site with a history; else None (the kernel writes
        act, and the product casts it). Either way `out` no longer holds an older producer's FP8 bytes. `head`: the
        fused classifier, writing the gradient of the classifier's backward (FP8 by fp8_classifier) into scratch,
        not over the logits, which the kernel's other blocks still read."""
        if self._fp8_held:
            self._fp8_held.pop((out.data.ptr, out.size), None)
        # (it needs the scale before the tensor exists, delayed scaling, and the weight gradient's product in FP8)
        if weight is None or not (able and self.fp8_fuse and self.fp8_wgrad and self._fp8_hist is not None):
            return None
        OC, C = weight.shape
        N = out.size // (C if role == "x" else OC)
        if not self._fp8_serves(N, C, OC, head, out, weight, backward=head):
            return None
        site = self._fp8_site(weight, role)
        if site is None or site in self._fp8_fresh:
            return None
        if head:
            return self._fp8_produce(out, site, role, self.scratch("fp8_head_dout", N * OC, np.uint8), "classifier")
        return self._fp8_produce(out, site, role, out)

    def _fp8_produce(self, buf, site: int, role: str, out8, kind: str | None = None):
        """Records that `buf` is held as FP8 bytes at out8 for the product of `site`, counted as `kind` (default:
        the role); the producer's FP8 output arguments."""
        self._fp8_held[(buf.data.ptr, buf.size)] = (site, role == "dout", out8.data.ptr)
        self.fp8_produced[kind or role] += 1
        amax, hist_n, stride, observe = self._fp8_history(site)
        return (out8, np.uint64(self._fp8_inv_of(site)), np.uint64(amax), np.int32(hist_n), np.int32(stride),
                np.uint64(observe))

    def _fp8_gelu_feeds(self, out, weight) -> bool:
        """Whether GELU's output `out` is the FP8 input of the product with `weight` (fp8_next) under delayed
        scaling, where GELU runs apart from the product before it, to be that product's producer."""
        if weight is None or self._fp8_hist is None or not self.fp8_wgrad:
            return False
        OC, C = weight.shape
        return self._fp8_serves(out.size // C, C, OC, False, out, weight)

    def _fp8_inv_of(self, site: int) -> int:
        """Where a producer left site's inverse scale."""
        return self._fp8_site_inv.data.ptr + 256 * site

    def _fp8_take_held(self, site: int, slot: int) -> int:
        """The slot's inverse scale, set to the one site's producer left: the products' cuBLASLt plans hold the
        slots' addresses (one plan, and one tuning race, a shape, not a site)."""
        inv = self._fp8_slot(slot)[1]
        cp.cuda.runtime.memcpyAsync(inv, self._fp8_inv_of(site), 4, cp.cuda.runtime.memcpyDeviceToDevice,
                                    self.stream.ptr)
        return inv

    def _fp8_held_site(self, buf, weight, role: str) -> int | None:
        """The site whose FP8 bytes a producer wrote over `buf` for this product, or None where buf holds act."""
        held = self._fp8_held.get((buf.data.ptr, buf.size)) if self._fp8_held else None
        if held is None:
            return None
        site = self._fp8_sites.get((weight.data.ptr, role))
        if held[0] != site:
            raise RuntimeError(f"a product met the FP8 {role} written for another one (site {held[0]}, not {site}): "
                               f"fp8_next must name the product that reads a tensor next")
        return site

    def _fp8_restore(self, *bufs) -> None:
        """A product about to run in bf16 (cuBLASLt refused its FP8 product, or a shape or option keeps it in bf16)
        reads act: FP8 bytes a producer wrote over one of `bufs` become act again, the values they stand for."""
        for buf in bufs:
            held = self._fp8_held.pop((buf.data.ptr, buf.size), None) if buf is not None and self._fp8_held else None
            if held is not None:
                src = held[2]
                if src == buf.data.ptr:  # (a copy: act's elements are wider than the bytes they replace)
                    src = self._fp8_arena(buf.size)[0].data.ptr
                    cp.cuda.runtime.memcpyAsync(src, buf.data.ptr, buf.size, cp.cuda.runtime.memcpyDeviceToDevice,
                                                self.stream.ptr)
                self._launch(self._k("fp8_dequantize", True), self._grid(buf.size, 8), _CAST_BLOCK,
                             (buf, np.uint64(src), np.uint64(self._fp8_inv_of(held[0])), np.int64(buf.size),
                              np.int32(held[1])))

    def _fp8_bytes(self, buf) -> int:
        """Where the FP8 bytes a producer wrote for `buf` lie."""
        return self._fp8_held[(buf.data.ptr, buf.size)][2]

    def _fp8_transposed(self, buf, rows, cols) -> int:
        """The transposed copy (cols, rows) of the FP8 bytes a producer wrote for `buf`, made in its second half."""
        t = buf.data.ptr + rows * cols
        self._launch(self._k("fp8_transpose", True), ((cols + 63) // 64, (rows + 63) // 64), 256,
                     (np.uint64(t), np.uint64(self._fp8_bytes(buf)), np.int32(rows), np.int32(cols)))
        return t

    def _fp8_forward(self, out, inp, weight, bias, pre_gelu, N, C, OC) -> bool:
        from nvmath.bindings.cublasLt import Epilogue as E
        held = self._fp8_held_site(inp, weight, "x")
        x8, w8 = self._fp8_arena(N * C if held is None else 0, OC * C)
        self._fp8_zero()
        if held is None:
            self._fp8_cast(inp, 0, N, C, out=x8, site=self._fp8_site(weight, "x"))
            x8, x_inv = x8.data.ptr, self._fp8_slot(0)[1]
        else:
            x8, x_inv = self._fp8_bytes(inp), self._fp8_take_held(held, 0)
        self._fp8_cast(weight, 1, OC, C, out=w8, site=self._fp8_site(weight, "w"))
        scales = (self._fp8_slot(1)[1], x_inv)
        b = bias.data.ptr if bias is not None else 0
        args = (x8, w8.data.ptr, N, C, OC, self.stream.ptr, scales)
        fast = self.fp8_fast_accum
        if pre_gelu is not None:
            if self.use_epilogues and self.lt.forward_fp8(out.data.ptr, *args, bias=b, aux=pre_gelu.data.ptr,
                                                          epilogue=E.GELU_AUX_BIAS if b else E.GELU_AUX,
                                                          fast_accum=fast):
                return True
            if not self.lt.forward_fp8(pre_gelu.data.ptr, *args, bias=b, fast_accum=fast):
                return False
            self.gelu_forward(out, pre_gelu)
            return True
        return self.lt.forward_fp8(out.data.ptr, *args, bias=b, fast_accum=fast)

    def _fp8_backward(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC, head=False) -> bool:
        """The backward in FP8 (`head`: the classifier's, whose transposed weight _fp8_head_t keeps); False, with
        nothing accumulated, where cuBLASLt has no FP8 algorithm (the bf16 path then runs)."""
        if not self.fp8_wgrad:
            return self._fp8_backward_dinp(dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC, head)
        held = self._fp8_held_site(dout, weight, "dout")
        x_cast = 0 if self._fp8_held_site(inp, weight, "x") is not None else N * C  # (bytes for the input's cast)
        wt = OC * C if dinp is not None and not head else 0  # (bytes for the weight's transposed cast)
        if held is not None:
            if dbias is not None:  # (its sums are taken from act values, which the producer did not write)
                raise RuntimeError("fp8_next named a product with a bias as the reader of its gradient")
            w8t, x8t = self._fp8_arena(wt, x_cast)
            self._fp8_zero()
            grad = (self._fp8_bytes(dout), self._fp8_take_held(held, 2))
            if dinp is not None and not self._fp8_dinp(dinp, grad, None if head else w8t, weight, pre_gelu, N, C, OC):
                return False
            if not self._fp8_dweight(dweight, None, (self._fp8_transposed(dout, N, OC), grad[1]), inp, weight,
                                     N, C, OC, x8t=x8t):
                return False
            # the gradient's bytes are spent: the engine may now place a buffer of the same size over that memory
            # (GPT-2's dresidual or dfch at the start of logits as large), which holds act when a product reads it
            del self._fp8_held[(dout.data.ptr, dout.size)]
            return True
        one_pass = N * OC + max(N * OC + wt, x_cast)
        if dinp is not None and one_pass > self.cudnn_workspace:
            return self._fp8_backward_two_pass(dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC, head)
        # the transposed gradient first; after it, the gradient and the weight for dinp, then (over them) the
        # transposed input for dweight
        d8t, rest = self._fp8_arena(N * OC, max(N * OC + wt, x_cast))
        d8, w8t = rest[:N * OC], rest[N * OC:N * OC + wt]
        self._fp8_zero()
        self._fp8_cast(dout, 2, N, OC, out=d8 if dinp is not None else None, out_t=d8t, e5m2=True,
                       site=self._fp8_site(weight, "dout"), sums=dbias is not None)
        inv = self._fp8_slot(2)[1]
        if dinp is not None and not self._fp8_dinp(dinp, (d8.data.ptr, inv), None if head else w8t, weight,
                                                   pre_gelu, N, C, OC):
            return False  # (nothing accumulated yet: the bf16 path redoes the product)
        return self._fp8_dweight(dweight, dbias, (d8t.data.ptr, inv), inp, weight, N, C, OC, x8t=rest)

    def _fp8_backward_two_pass(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC, head) -> bool:
        """The backward of a product whose one-pass casts (the gradient normal and transposed at once) would need
        more bytes than cuDNN's attention workspace, which the casts share: the gradient cast twice, once for dinp
        and once, transposed, for dweight, in half the bytes for one more read of it (the same scale, so the same
        bits: Llama 3.2-1B's w13, whose gradient is 16384 x 16384 at B=8 T=2048)."""
        site = self._fp8_site(weight, "dout")
        d8, w8t = self._fp8_arena(N * OC, 0 if head else OC * C)
        self._fp8_zero()
        self._fp8_cast(dout, 2, N, OC, out=d8, e5m2=True, site=site)
        inv = self._fp8_slot(2)[1]
        if not self._fp8_dinp(dinp, (d8.data.ptr, inv), None if head else w8t, weight, pre_gelu, N, C, OC):
            return False  # (nothing accumulated yet: the bf16 path redoes the product)
        return self._fp8_backward_wgrad(dweight, dbias, dout, inp, weight, N, C, OC)

    def _fp8_dweight(self, dweight, dbias, grad_t, inp, weight, N, C, OC, x8t=None) -> bool:
        """dweight += the FP8 gradient grad_t = (transposed bytes, inverse scale) times inp, cast transposed into
        x8t here (or transposed from a producer's FP8 bytes); then dbias += the sums the gradient's cast took.
        False, with neither touched, if cuBLASLt has no FP8 algorithm."""
        held = self._fp8_held_site(inp, weight, "x")
        if held is None:
            self._fp8_cast(inp, 0, N, C, out_t=x8t, site=self._fp8_site(weight, "x"))
            x = (x8t.data.ptr, self._fp8_slot(0)[1])
        else:
            x = (self._fp8_transposed(inp, N, C), self._fp8_take_held(held, 0))
        if not self.lt.backward_weight_fp8(dweight.data.ptr, grad_t[0], x[0], N, C, OC, self.stream.ptr,
                                           (x[1], grad_t[1])):
            return False  # (dinp is overwritten by the bf16 path; dweight and dbias untouched so far)
        if dbias is not None:
            self._fp8_add_sums(dbias, N, OC)
        return True

    def _fp8_dinp(self, dinp, grad, w8t, weight, pre_gelu, N, C, OC) -> bool:
        """dinp from the FP8 gradient grad = (bytes, inverse scale) and the weight cast transposed into w8t here
        (None: the classifier's, _fp8_head_t); False if cuBLASLt has no FP8 algorithm for it."""
        s = self.stream.ptr
        if w8t is None:
            w8t = self._fp8_head_t(weight, OC, C)
        else:
            self._fp8_cast(weight, 1, OC, C, out_t=w8t, site=self._fp8_site(weight, "w"))
            w8t = w8t.data.ptr
        scales = (self._fp8_slot(1)[1], grad[1])
        if pre_gelu is not None and self.use_epilogues and self.lt.backward_input_fp8(
                dinp.data.ptr, grad[0], w8t, N, C, OC, s, scales, pre_gelu=pre_gelu.data.ptr):
            return True
        if not self.lt.backward_input_fp8(dinp.data.ptr, grad[0], w8t, N, C, OC, s, scales):
            return False
        if pre_gelu is not None:
            self.gelu_backward(dinp, pre_gelu, dinp)
        return True

    def _fp8_head_t(self, weight, OC, C) -> int:
        """The classifier's weight cast transposed, its inverse scale in slot 1: cast by the step's first chunk and
        kept for the others (the same weight and scale, so the same bytes); cast every call outside a step, in a
        graph recorded between steps too."""
        at = -(-OC * C // 256) * 256
        buf = self.scratch("fp8_head_t", at + 256, np.uint8)
        inv, kept = self._fp8_slot(1)[1], buf.data.ptr + at
        key = (weight.data.ptr, self._fp8_step)
        if self._fp8_step and self._fp8_head_of == key:
            src, dst = kept, inv
        else:
            self._fp8_cast(weight, 1, OC, C, out_t=buf[:OC * C], site=self._fp8_site(weight, "w"))
            self._fp8_head_of, src, dst = key, inv, kept
        cp.cuda.runtime.memcpyAsync(dst, src, 4, cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
        return buf.data.ptr

    def _fp8_backward_wgrad(self, dweight, dbias, dout, inp, weight, N, C, OC) -> bool:
        """The weight gradient in FP8, the gradient cast transposed here (its scale is the site's, so a cast of it
        for dinp before gives the same bits). For the second pass of _fp8_backward_two_pass, and (fp8_dgelu=off)
        for a product whose dinp takes GELU's derivative: its input, GELU's output, is often a producer's FP8 bytes,
        and its dinp stays the caller's, in bf16 with the derivative in cuBLASLt's epilogue (its FP8 products have
        none)."""
        x_cast = 0 if self._fp8_held_site(inp, weight, "x") is not None else N * C
        d8t, x8t = self._fp8_arena(N * OC, x_cast)
        self._fp8_zero()
        self._fp8_cast(dout, 2, N, OC, out_t=d8t, e5m2=True, site=self._fp8_site(weight, "dout"),
                       sums=dbias is not None)
        return self._fp8_dweight(dweight, dbias, (d8t.data.ptr, self._fp8_slot(2)[1]), inp, weight, N, C, OC,
                                 x8t=x8t)

    def _fp8_backward_dinp(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC, head) -> bool:
        """fp8_wgrad=off: dinp in FP8 (no transposed gradient needed), the weight gradient in bf16."""
        self._fp8_restore(inp, dout)  # (produced while fp8_wgrad was on: the option changed in between)
        if dinp is not None:
            d8, w8t = self._fp8_arena(N * OC, 0 if head else OC * C)
            self._fp8_zero()
            self._fp8_cast(dout, 2, N, OC, out=d8, e5m2=True, site=self._fp8_site(weight, "dout"))
            if not self._fp8_dinp(dinp, (d8.data.ptr, self._fp8_slot(2)[1]), None if head else w8t, weight,
                                  pre_gelu, N, C, OC):
                return False
        self._dweight(dweight, dbias, dout, inp, N, C, OC)
        return True
