"""On the GPU: the Mosaic GPU tree-attention kernel at small shapes (H 6, c 64, r 64) against its reference (bf16 and
f16: the kernel takes no float32), and the greedy invariant (DDTree/DFlash == AR) of the tiny model in float32 with
each attention path named by --attention.

The invariant runs in float32, where the attention is XLA's (`--attention xla`, the default). `--attention mosaic_gpu`
is accepted so that asking for the kernel in the loop fails loudly: the Mosaic kernel takes bf16 / f16 only, so in
this check it raises KernelUnavailableError (as it does on a CPU or a GPU other than Hopper), never replaced by an
XLA run reported under its name.

Usage: python benchmarks/check_gpu_invariant.py [--precision highest|default] [--attention xla] [--out DIR]
Writes DIR/gpu_invariant_<platform>.json and .md with the run's metadata (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kdtree_jax as kj  # noqa: E402
from benchmarks.common import metadata, set_matmul_precision, write_results  # noqa: E402
from pallas_kernels.tree_attention import tree_mla_attention, tree_mla_attention_reference  # noqa: E402


def kernel_rows():
    rng = np.random.default_rng(0)
    rows = []
    for dtype in (jnp.bfloat16, jnp.float16):
        for steps in (1, 5, 8, 17, 65):
            batch, heads, c, r, s_max = 3, 6, 64, 64, 200  # c + r a multiple of 64: the kernel's TMA tiling
            start = np.array([0, 37, 120], np.int32)
            q = jnp.asarray(rng.standard_normal((batch, steps, heads, c + r)), dtype)
            cache = jnp.asarray(rng.standard_normal((batch, s_max, c + r)), dtype)
            mask = np.tril(rng.random((batch, steps, steps)) < 0.5) | np.eye(steps, dtype=bool)[None]
            args = (q, cache, jnp.asarray(start), jnp.asarray(mask))
            got = tree_mla_attention(*args, scale=0.12, value_dim=c, impl="mosaic_gpu")
            ref = tree_mla_attention_reference(*args, scale=0.12, value_dim=c)
            err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
            rows.append((jnp.dtype(dtype).name, steps, err))
    return rows


def invariant_rows(impls):
    cfg = kj.ModelConfig.tiny()
    params = kj.init_params(cfg, jax.random.key(0))
    prompts = [[5, 17, 33, 250], [7], [100, 101, 102, 103, 104, 105]]
    dcfg = kj.DrafterConfig.for_target(cfg, num_layers=1, block_size=8)
    drafter = (dcfg, kj.init_drafter_params(dcfg, jax.random.key(1)))
    rows = []
    for impl in impls:
        kernels = kj.Kernels(attention=impl)  # explicit: "mosaic_gpu" where it cannot run raises, never runs XLA
        ar = kj.generate(cfg, params, prompts, max_new_tokens=48, stop_tokens=(), kernels=kernels)
        for method, budget in (("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)):
            out = kj.generate(cfg, params, prompts, max_new_tokens=48, method=method, drafter=drafter,
                              tree_budget=budget, stop_tokens=(), kernels=kernels)
            same = np.asarray(out.tokens) == np.asarray(ar.tokens)
            first = int(np.argmin(same.all(0))) if not same.all() else -1
            rows.append((impl, method, budget, bool(same.all()), first))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--precision", default="highest", choices=("highest", "default"),
                        help="jax_default_matmul_precision for float32 (default: highest, no TF32)")
    parser.add_argument("--attention", nargs="+", default=["xla"], choices=("xla", "mosaic_gpu"),
                        help="attention paths to check the invariant with (default: xla; mosaic_gpu raises "
                             "KernelUnavailableError in this float32 check)")
    parser.add_argument("--skip-kernel", action="store_true", help="skip the Mosaic kernel-vs-reference table")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="results folder")
    args = parser.parse_args()
    set_matmul_precision(args.precision)
    meta = metadata(precision=args.precision, attention=args.attention)
    print(meta, flush=True)
    md = [f"# Tree attention and the greedy invariant on {meta['device']} (precision {args.precision})", ""]
    kernel = [] if args.skip_kernel else kernel_rows()
    if kernel:
        md += ["| dtype | T | Mosaic kernel rel err vs reference |", "|---|---|---|"]
        md += [f"| {dtype} | {steps} | {err:.2e} |" for dtype, steps, err in kernel]
        md.append("")
    invariant = invariant_rows(args.attention)
    md += ["| attention | method | budget | == AR | first differing step |", "|---|---|---|---|---|"]
    md += [f"| {impl} | {method} | {budget} | {'yes' if same else 'NO'} | {first} |"
           for impl, method, budget, same, first in invariant]
    print("\n".join(md))
    data = {"kernel": [dict(zip(("dtype", "T", "rel_err"), row, strict=True)) for row in kernel],
            "invariant": [dict(zip(("attention", "method", "budget", "same", "first_diff"), row, strict=True))
                          for row in invariant]}
    write_results(os.path.join(args.out, f"gpu_invariant_{meta['platform']}"), meta, data, "\n".join(md))


if __name__ == "__main__":
    main()
