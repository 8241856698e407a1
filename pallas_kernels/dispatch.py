"""The one place that decides which implementation each kernel op runs.

Ops and their implementations:
  attention (tree-masked absorbed MLA):     "mosaic_gpu" | "xla"
  linear    (dense W4A16 GEMM):              "mosaic_gpu" (MosaicInt4Weight) | "xla"
  moe       (routed INT4 experts):           "triton" (Int4Weight) | "mosaic_gpu" (MosaicInt4Weight) | "xla"
  tree      (DDTree best-first tree build):  "triton" (one launch) | "xla" (kdtree_jax/tree.py's jnp builder)
  mla       (the cached MLA's projections):  "folded" (W_UK pre-multiplied into q_b, W_UV into o, q_a and kv_a one
                                             matrix: fewer, larger matmuls) | "separate" (the checkpoint's matrices)
"xla" is the op's plain-jnp path run by XLA: correct everywhere, not fast.

Rules for impl="auto" (from backend, dtype, shape and weight type):
  - a Pallas kernel needs a GPU, or `interpret=True` (the CPU simulation the tests use); elsewhere "xla";
  - tree attention on a GPU: the implementation measured fastest at the call shape (tree_attention.tuned.
    measured_fastest) that can run here: the Mosaic kernel needs a Hopper GPU, bf16 / f16, c a multiple of 64, a
    power-of-two RoPE width >= 16 and c + r a multiple of 64 (interpret mode: any c + r); else "xla";
  - the MLA projections are folded when the folded matrices add at most FOLD_MAX_EXTRA_BYTES a layer (a small
    model, whose decode step is launch-bound: one matmul instead of three saves launches that cost more than
    reading the extra bytes), separate otherwise (K2.6: folding would add 392 MiB of bf16 weights a layer); the
    fold also joins each MLP's entry matrices, and on a GPU keeps [N, K] copies for one-row products (fold_transposed);
  - the routed MoE kernel follows from the experts' type: Int4Weight -> "triton", MosaicInt4Weight ->
    "mosaic_gpu" (a Hopper GPU, bf16 activations, expert dims multiples of 64); a small expert stack, where XLA
    measured faster (moe_w4a16.tuned.measured_fastest), runs "xla" on a GPU too;
  - an INT4 dense linear follows from its weight's type the same way: MosaicInt4Weight -> "mosaic_gpu" (a Hopper
    GPU, bf16 activations, dims multiples of 64, at most LINEAR_MAX_ROWS rows a call; a longer call, a prefill,
    runs XLA over the same weight), Int4Weight -> "xla"; a weight under LINEAR_MIN_ELEMENTS keeps the checkpoint
    layout (XLA measured faster there).
An explicit impl that cannot run where it is asked for raises KernelUnavailableError (never a fallback).
Which layout the routed experts and the INT4 dense weights should be in (`choose_moe_layout`,
`choose_linear_layout`) is decided here too; the engine converts them once (kdtree_jax.kernels.prepare_params)
and the kernel then follows from the weight type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.int4 import Int4Weight, MosaicInt4Weight
from pallas_kernels.tree_build import kernel_shape_unsupported as tree_shape_unsupported

AUTO = "auto"
IMPLS = {
    "attention": ("mosaic_gpu", "xla"),
    "linear": ("mosaic_gpu", "xla"),
    "moe": ("triton", "mosaic_gpu", "xla"),
    "tree": ("triton", "xla"),
    "mla": ("folded", "separate"),
}
MOSAIC_DIM_MULTIPLE = 64  # Mosaic MoE: hidden and intermediate are N of one launch (wgmma M) and K of another


class KernelUnavailableError(ValueError):
    """An explicitly requested kernel cannot run here (device, dtype, shape or weight type)."""


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Per-call kernel choice, passed statically through forward / generate (hashable).

    attention: "auto" | "mosaic_gpu" | "xla"; linear: "auto" | "mosaic_gpu" | "xla" (also which layout
    prepare_params gives the INT4 dense weights);
    moe: "auto" | "triton" | "mosaic_gpu" | "xla" (also which layout prepare_params gives the routed experts);
    tree: "auto" | "triton" | "xla" (the DDTree tree build);
    mla: "auto" | "folded" | "separate" (the cached MLA's projections inside `generate`: choose_mla);
    interpret: run the Pallas kernels in interpret mode (CPU simulation; tests only, slow)."""

    attention: str = AUTO
    linear: str = AUTO
    moe: str = AUTO
    tree: str = AUTO
    mla: str = AUTO
    interpret: bool = False

    def __post_init__(self):
        for op, impls in IMPLS.items():
            value = getattr(self, op)
            if value != AUTO and value not in impls:
                raise ValueError(f"Kernels.{op} must be one of {(AUTO, *impls)}, got {value!r}")
        if not isinstance(self.interpret, bool):
            raise ValueError(f"Kernels.interpret must be a bool, got {self.interpret!r}")


def as_kernels(kernels: Kernels | None) -> Kernels:
    """`kernels` checked (None: every op on "auto"); the one check behind every public `kernels=` argument."""
    if kernels is None:
        return Kernels()
    if not isinstance(kernels, Kernels):
        raise ValueError(f"kernels must be a kdtree_jax.Kernels, got {type(kernels).__name__}")
    return kernels


@dataclasses.dataclass(frozen=True)
class Choice:
    """What an op runs: impl (one of IMPLS[op]) and why, in a few words."""

    impl: str
    reason: str


# ------------------------------------------------------------------------------------------- devices
def default_device():
    return jax.devices()[0]


def is_gpu(device) -> bool:
    return getattr(device, "platform", None) == "gpu"


def is_hopper(device) -> bool:
    """An sm_90 GPU (H100 / H200): what the Mosaic GPU kernels target."""
    return is_gpu(device) and str(getattr(device, "compute_capability", "")).startswith("9.")


HOPPER_SMS = 132  # H100 SXM and H200; an H100 PCIe has 114


def sm_count(device=None) -> int:
    """The device's streaming multiprocessors (`core_count` of a GPU device), HOPPER_SMS where there is no GPU (CPU
    tests, interpret mode, a deviceless compile for an abstract H100 / H200): what the kernels' work plans divide."""
    device = device if device is not None else default_device()
    count = getattr(device, "core_count", None) if is_gpu(device) else None
    return int(count) if count else HOPPER_SMS


def _device_name(device) -> str:
    return getattr(device, "device_kind", None) or getattr(device, "platform", "?")


def _check_impl(op: str, impl: str) -> None:
    if impl != AUTO and impl not in IMPLS[op]:
        raise ValueError(f"{op} impl must be one of {(AUTO, *IMPLS[op])}, got {impl!r}")


def _pallas_runs(device, interpret: bool) -> str | None:
    """Why a Pallas kernel cannot run on `device`, or None."""
    if interpret or is_gpu(device):
        return None
    return f"no GPU, this is {_device_name(device)}"


def _unavailable(op: str, impl: str, why: str, hint: str) -> KernelUnavailableError:
    return KernelUnavailableError(f"{op} impl={impl!r} cannot run: {why}; {hint}")


# ------------------------------------------------------------------------------------------- attention
def mosaic_attention_unsupported(device, interpret: bool, latent_dim: int, rope_dim: int, dtype) -> str | None:
    """Why the Mosaic GPU tree-attention kernel cannot run here, or None (dtype None: not checked)."""
    if not interpret and not is_hopper(device):
        return f"needs a Hopper GPU (sm_90), this is {_device_name(device)}"
    if dtype is not None and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bf16 or f16, the model runs in {jnp.dtype(dtype).name}"
    from pallas_kernels.tree_attention.mosaic_gpu import width_problem  # noqa: PLC0415 (imports the kernel)

    return width_problem(latent_dim, rope_dim, native=not interpret)


def choose_attention(*, latent_dim: int, rope_dim: int, impl: str = AUTO, device=None,
                     interpret: bool = False, num_heads: int | None = None, dtype=None,
                     num_tree: int | None = None, cache_rows: int | None = None) -> Choice:
    """The tree attention. On a GPU, auto runs the implementation measured fastest at the call shape that can run
    here (tree_attention.tuned.measured_fastest; needs num_heads and dtype, and num_tree / cache_rows for one call;
    without num_heads / dtype: the Mosaic kernel where it can run). interpret=True on a CPU: the Mosaic kernel in
    its interpret mode where the dtype and widths allow it, else XLA."""
    _check_impl("attention", impl)
    device = device or default_device()
    if impl == "xla":
        return Choice("xla", "asked for")
    mosaic_why = mosaic_attention_unsupported(device, interpret, latent_dim, rope_dim, dtype)
    if impl == "mosaic_gpu":
        if mosaic_why:
            raise _unavailable("attention", impl, mosaic_why, "use the XLA reference (impl 'xla') or interpret mode")
        return Choice("mosaic_gpu", "asked for")
    if not is_gpu(device):
        if not interpret:
            return Choice("xla", f"no GPU, this is {_device_name(device)}")
        return Choice("xla", mosaic_why) if mosaic_why else Choice("mosaic_gpu", "interpret mode")
    if num_heads is None or dtype is None:
        return Choice("xla", mosaic_why) if mosaic_why else Choice("mosaic_gpu", "Hopper GPU")
    from pallas_kernels.tree_attention.tuned import measured_fastest  # noqa: PLC0415 (imports the kernels)

    ranked, why = measured_fastest(num_heads=num_heads, latent_dim=latent_dim, rope_dim=rope_dim, dtype=dtype,
                                   num_tree=num_tree, cache_rows=cache_rows)
    if ranked[0] == "mosaic_gpu" and mosaic_why:
        return Choice("xla", f"{why}; not mosaic_gpu: {mosaic_why}")
    return Choice(ranked[0], why)


# ------------------------------------------------------------------------------------------- MLA projections
# The folded MLA projections may read at most this many more bytes a layer than the separate ones: 4 MiB is 1.3 us at
# the H200's 3.3 TB/s, under the two to four kernel launches folding saves (each about 2 us there).
FOLD_MAX_EXTRA_BYTES = 4 << 20


def mla_fold_extra_bytes(*, hidden: int, q_lora_rank: int | None, num_heads: int, qk_nope_head_dim: int,
                         qk_rope_head_dim: int, v_head_dim: int, kv_lora_rank: int, itemsize: int) -> int:
    """Bytes a layer's folded projections (query [q_in, H*(c+r)], output [H*c, D]) read beyond the separate
    ones they replace (q_b or q [q_in, H*(n+r)], kv_b [c, H*(n+v)], o [H*v, D]); q_in = q_lora_rank or D."""
    h, n, r, v, c = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
    q_in = q_lora_rank or hidden
    folded = q_in * h * (c + r) + h * c * hidden
    separate = q_in * h * (n + r) + c * h * (n + v) + h * v * hidden
    return (folded - separate) * itemsize


def choose_mla(*, extra_bytes: int, impl: str = AUTO, sharded: bool = False) -> Choice:
    """The cached MLA's projections: "folded" when they add at most FOLD_MAX_EXTRA_BYTES a layer (extra_bytes:
    mla_fold_extra_bytes) on one device; "separate" on a mesh (the folded matrices have no declared sharding)."""
    _check_impl("mla", impl)
    if impl == "separate":
        return Choice("separate", "asked for")
    if sharded:
        if impl == "folded":
            raise _unavailable("mla", impl, "the folded projections have no sharding (a device mesh is in use)",
                               "use the separate projections (impl 'separate')")
        return Choice("separate", "sharded over a mesh")
    if impl == "folded":
        return Choice("folded", "asked for")
    if extra_bytes <= FOLD_MAX_EXTRA_BYTES:
        return Choice("folded", f"small model: {max(extra_bytes, 0) / 2**20:.1f} MiB more a layer, fewer launches")
    return Choice("separate", f"folding would add {extra_bytes / 2**20:.0f} MiB of weights a layer")


def fold_transposed(device=None) -> bool:
    """Whether the fold also keeps a transposed copy, [N, K], of the matrices x multiplies directly (the folded MLA's
    x and output projections, the MLP entries) for one-row products: on a GPU, where XLA runs a one-row x @ W as one
    kernel with W [N, K] and as a product + a row reduction with W [K, N] (benchmarks/results/matvec_h200.md: 1.1
    vs 3.5 us at 384 x 352; the shipped pair's AR step 432 -> 353 us of kernels, round_profile_2026-12-03_s13_nk.md);
    more rows keep W [K, N] (at 8 rows the [N, K] GEMMs measured 34 us slower a verify). Not on a CPU, where the
    shipped pair's AR decode measured 8% slower with [N, K]."""
    return is_gpu(device or default_device())


# ------------------------------------------------------------------------------------------- tree build
def choose_tree(*, budget: int, depth_count: int, impl: str = AUTO, device=None, interpret: bool = False) -> Choice:
    """The DDTree tree build of `budget` drafts over `depth_count` draft positions: the one-launch Triton
    kernel (pallas_kernels.tree_build) on a GPU, the jnp builder (kdtree_jax.tree) elsewhere."""
    _check_impl("tree", impl)
    device = device or default_device()
    if impl == "xla":
        return Choice("xla", "asked for")
    why = _pallas_runs(device, interpret) or tree_shape_unsupported(budget, depth_count)
    if impl == "triton":
        if why:
            raise _unavailable("tree", impl, why, "use the jnp builder (impl 'xla') or interpret mode")
        return Choice("triton", "asked for")
    if why:
        return Choice("xla", why)
    return Choice("triton", "interpret mode" if interpret and not is_gpu(device) else "GPU")


# ------------------------------------------------------------------------------------------- linear
# The dense Mosaic kernel under auto, from benchmarks/results/w4a16_mosaic_h200_s16.md (H200, 2026-12-03, CUPTI):
# at most LINEAR_MAX_ROWS rows a call (measured up to 64: at K2.6 shapes 2.6-6.7x faster than XLA's INT4 form; 256 rows
# overflowed its shared memory at block_k 256, 65..255 were not measured: XLA), and weights of at least
# LINEAR_MIN_ELEMENTS (at 384 x 1024, 0.4 M, XLA took 1.3 us at M = 1 against the kernel's 3.7; the kernel was
# 1.2-1.6x faster at M 8..64, by at most 1.8 us; sizes between that and 2048 x 7168 were not measured).
LINEAR_MAX_ROWS = 64
LINEAR_MIN_ELEMENTS = 1 << 20


def mosaic_linear_unsupported(device, interpret: bool, act_dtype, in_features: int, out_features: int) -> str | None:
    """Why the dense Mosaic W4A16 kernel cannot run a [out, in] weight here, or None (act_dtype None: not checked)."""
    if not interpret and not is_hopper(device):
        return f"needs a Hopper GPU (sm_90), this is {_device_name(device)}"
    if act_dtype is not None and jnp.dtype(act_dtype) != jnp.dtype(jnp.bfloat16):
        return f"needs bf16 activations, the model runs in {jnp.dtype(act_dtype).name}"
    bad = [f"{name} {dim}" for name, dim in (("in", in_features), ("out", out_features)) if dim % MOSAIC_DIM_MULTIPLE]
    return f"{' and '.join(bad)} features not a multiple of {MOSAIC_DIM_MULTIPLE}" if bad else None


def _linear_xla_faster(in_features: int, out_features: int) -> str | None:
    """Why XLA runs a weight this small under auto (measured faster at one row), or None."""
    elements = in_features * out_features
    if elements < LINEAR_MIN_ELEMENTS:
        return f"small weight ({in_features} x {out_features}): XLA measured faster at one row"
    return None


def choose_linear_layout(*, act_dtype, scale_dtype, in_features: int, out_features: int, impl: str = AUTO,
                         device=None, interpret: bool = False) -> Choice:
    """Which layout a canonical INT4 dense weight should run in: "mosaic_gpu" (convert once to MosaicInt4Weight)
    or "xla" (keep the Int4Weight). impl: the requested linear kernel; "mosaic_gpu" raises where it cannot run.
    float32 scales stay canonical under auto (the Mosaic layout rounds them to bf16)."""
    _check_impl("linear", impl)
    device = device or default_device()
    if impl == "xla":
        return Choice("xla", "asked for")
    why = mosaic_linear_unsupported(device, interpret, act_dtype, in_features, out_features)
    if why is None and impl == AUTO and jnp.dtype(scale_dtype) != jnp.dtype(jnp.bfloat16):
        why = f"the INT4 scales are {jnp.dtype(scale_dtype).name}, not bfloat16"
    if why is None and impl == AUTO and not interpret:
        why = _linear_xla_faster(in_features, out_features)
    if impl == "mosaic_gpu":
        if why:
            raise _unavailable("linear", impl, why, "use the XLA path (impl 'xla')")
        return Choice("mosaic_gpu", "asked for")
    return Choice("xla", why) if why else Choice("mosaic_gpu", "Hopper GPU, bf16")


def choose_linear(weight: Any, *, impl: str = AUTO, device=None, interpret: bool = False, rows: int | None = None,
                  act_dtype=None) -> Choice:
    """A dense INT4 linear of `rows` rows (None: a decode-size call) from its weight's layout: a MosaicInt4Weight runs
    the dense Mosaic GPU kernel (a Hopper GPU or interpret mode, bf16 activations, dims multiples of 64, at most
    LINEAR_MAX_ROWS rows; under auto on a GPU also at least LINEAR_MIN_ELEMENTS weights), an Int4Weight XLA.
    Under auto a call the kernel cannot take runs XLA over the same weight; an explicit "mosaic_gpu" raises there."""
    _check_impl("linear", impl)
    if not isinstance(weight, Int4Weight | MosaicInt4Weight):
        raise KernelUnavailableError(f"the W4A16 linear takes an Int4Weight or MosaicInt4Weight, got "
                                     f"{type(weight).__name__}")
    device = device or default_device()
    if impl == "xla":
        return Choice("xla", "asked for")
    if isinstance(weight, Int4Weight):
        if impl == "mosaic_gpu":
            raise KernelUnavailableError("linear impl='mosaic_gpu' needs the weight in the Mosaic layout "
                                         "(MosaicInt4Weight), got an Int4Weight: convert the params once "
                                         "(kdtree_jax.kernels.prepare_params) with the same kernel choice")
        return Choice("xla", "checkpoint layout (Int4Weight)")
    why = mosaic_linear_unsupported(device, interpret, act_dtype, weight.in_features, weight.out_features)
    if why is None and rows is not None and rows > LINEAR_MAX_ROWS:
        why = f"{rows} rows > {LINEAR_MAX_ROWS} (measured faster up to {LINEAR_MAX_ROWS})"
    if why is None and impl == AUTO and not interpret:
        why = _linear_xla_faster(weight.in_features, weight.out_features)
    if why is None:
        return Choice("mosaic_gpu", "asked for" if impl == "mosaic_gpu" else
                      ("interpret mode" if interpret and not is_gpu(device) else "Hopper GPU, bf16"))
    if impl == "mosaic_gpu":
        raise _unavailable("linear", impl, why, "use the XLA path (impl 'xla')")
    return Choice("xla", why)


# ------------------------------------------------------------------------------------------- moe
def mosaic_moe_shape_unsupported(hidden: int, inter: int) -> str | None:
    """Why experts hidden -> inter -> hidden cannot run on the Mosaic GPU MoE kernel, or None."""
    bad = [f"{name} {dim}" for name, dim in (("hidden", hidden), ("intermediate", inter))
           if dim % MOSAIC_DIM_MULTIPLE]
    return f"{' and '.join(bad)} not a multiple of {MOSAIC_DIM_MULTIPLE}" if bad else None


def _mosaic_runs(device, interpret: bool, act_dtype, hidden: int, inter: int) -> str | None:
    """Why the Mosaic GPU MoE kernel cannot run here, or None."""
    if not interpret and not is_hopper(device):
        return f"needs a Hopper GPU (sm_90), this is {_device_name(device)}"
    if jnp.dtype(act_dtype) != jnp.dtype(jnp.bfloat16):
        return f"needs bf16 activations, the model runs in {jnp.dtype(act_dtype).name}"
    return mosaic_moe_shape_unsupported(hidden, inter)


def _experts_type(experts: Any) -> type | None:
    """Int4Weight / MosaicInt4Weight when all of gate/up/down have that type, None for dense arrays."""
    if not isinstance(experts, dict) or set(experts) != {"gate", "up", "down"}:
        got = sorted(experts) if isinstance(experts, dict) else type(experts).__name__
        raise ValueError(f"experts must be a dict with keys down, gate, up, got {got}")
    kinds = {type(w) for w in experts.values()}
    if len(kinds) != 1:
        raise ValueError(f"experts gate/up/down must share one type, got {sorted(k.__name__ for k in kinds)}")
    kind = kinds.pop()
    return kind if kind in (Int4Weight, MosaicInt4Weight) else None


def _xla_measured_faster(num_experts: int, hidden: int, inter: int) -> str | None:
    """Why XLA runs this routed stack on a GPU under auto (measured faster than the kernels), or None."""
    from pallas_kernels.moe_w4a16.tuned import measured_fastest  # noqa: PLC0415 (imports the kernels)

    xla_faster, reason = measured_fastest(num_experts, hidden, inter)
    return reason if xla_faster else None


def choose_moe_layout(*, act_dtype, scale_dtype, hidden: int, inter: int, impl: str = AUTO, device=None,
                      interpret: bool = False, num_experts: int | None = None) -> Choice:
    """Which layout canonical INT4 routed experts should run in: "mosaic_gpu" (convert once to
    MosaicInt4Weight) or "triton" (keep Int4Weight; also the layout of the "xla" path). impl: the
    requested moe kernel; "mosaic_gpu" raises when it cannot run. f32 scales stay canonical under "auto"
    (the Mosaic layout rounds them to bf16: different numbers than the Triton path), and so does a small stack of
    num_experts that auto runs on XLA (choose_moe)."""
    _check_impl("moe", impl)
    device = device or default_device()
    if impl in ("triton", "xla"):
        return Choice("triton", "asked for")
    why = _mosaic_runs(device, interpret, act_dtype, hidden, inter)
    if why is None and impl == AUTO and num_experts is not None and is_gpu(device):
        why = _xla_measured_faster(num_experts, hidden, inter)
    if why is None and impl == AUTO and jnp.dtype(scale_dtype) != jnp.dtype(jnp.bfloat16):
        why = f"the INT4 scales are {jnp.dtype(scale_dtype).name}, not bfloat16"
    if impl == "mosaic_gpu":
        if why:
            raise _unavailable("moe", impl, why, "use the Triton kernel (impl 'triton') or the XLA reference")
        return Choice("mosaic_gpu", "asked for")
    if why:
        return Choice("triton", why)
    return Choice("mosaic_gpu", "Hopper GPU, bf16")


def choose_moe(experts: Any, *, act_dtype, impl: str = AUTO, device=None, interpret: bool = False) -> Choice:
    """The routed experts' implementation from their weight type (experts: {"gate","up","down"} of
    Int4Weight or MosaicInt4Weight, stacked [E, ...]); on a GPU, auto runs XLA for a stack small enough that it
    measured faster than the kernels (moe_w4a16.tuned.measured_fastest)."""
    _check_impl("moe", impl)
    kind = _experts_type(experts)
    if kind is None:
        raise KernelUnavailableError("the grouped MoE kernels take INT4 experts (Int4Weight or MosaicInt4Weight), "
                                     f"got {type(experts['gate']).__name__}")
    device = device or default_device()
    kernel = "mosaic_gpu" if kind is MosaicInt4Weight else "triton"
    if impl == "xla":
        return Choice("xla", "asked for")
    if impl not in (AUTO, kernel):
        layout = {"triton": "the checkpoint layout (Int4Weight)", "mosaic_gpu": "the Mosaic layout (MosaicInt4Weight)"}
        raise KernelUnavailableError(f"moe impl={impl!r} needs experts in {layout[impl]}, got {kind.__name__}: "
                                     "convert the params once (kdtree_jax.kernels.prepare_params) with the same "
                                     "kernel choice")
    if kernel == "triton":
        why = _pallas_runs(device, interpret)
    else:
        hidden, inter = experts["gate"].in_features, experts["gate"].out_features
        why = _pallas_runs(device, interpret) or _mosaic_runs(device, interpret, act_dtype, hidden, inter)
    if why is None and impl == AUTO and is_gpu(device):
        gate = experts["gate"]
        reason = _xla_measured_faster(gate.lead_shape[0], gate.in_features, gate.out_features)
        if reason:
            return Choice("xla", reason)
    if why is None:
        return Choice(kernel, "asked for" if impl == kernel else
                      ("interpret mode" if interpret and not is_gpu(device) else "GPU"))
    if impl == AUTO and not is_gpu(device) and not interpret:
        return Choice("xla", why)  # the CPU plan: the XLA reference over the same weights
    hint = ("use the XLA reference (impl 'xla') or interpret mode" if kernel == "triton" else
            "keep the experts in the checkpoint layout (Triton kernel) or use the XLA reference (impl 'xla')")
    raise _unavailable("moe", impl if impl != AUTO else kernel, why, hint)
