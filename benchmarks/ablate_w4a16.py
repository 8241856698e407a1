"""What limits the W4A16 Triton kernel? Device-side (CUPTI) ablations at K=7168, N=18432, M=16:
the tuned kernel and a wider sweep; the same Pallas-Triton loop on bf16 weights (skeleton ceiling);
the same loop on the int4 bytes without unpacking (load + dot ceiling at int4 byte volume).

  python benchmarks/ablate_w4a16.py --out DIR    (GPU only; writes DIR/w4a16_ablation.json and .md with the
  run's metadata; timing: benchmarks/common.py Timer)
"""

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from benchmarks.common import Timer, metadata, write_results  # noqa: E402
from pallas_kernels.int4 import Int4Weight  # noqa: E402
from pallas_kernels.w4a16 import BlockConfig, get_config, w4a16_matmul  # noqa: E402


def skeleton(x, w, *, bn, bk, bm, warps, stages):
    """y^T tiles = w [N, Kw] (bf16, or int16 bitcast to bf16) . x [M, Kw]^T, same loop as the kernel."""
    m, kw = x.shape
    n = w.shape[0]

    def kernel(x_ref, w_ref, o_ref):
        n0 = pl.program_id(1) * bn

        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            xt = pltriton.load(x_ref.at[pl.ds(0, bm), pl.ds(k0, bk)])
            wt = pltriton.load(w_ref.at[pl.ds(n0, bn), pl.ds(k0, bk)], eviction_policy="evict_first")
            if wt.dtype == jnp.int16:
                wt = lax.bitcast_convert_type(wt, jnp.bfloat16)
            return acc + lax.dot_general(wt, xt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, kw // bk, body, jnp.zeros((bn, bm), jnp.float32))
        o_ref[...] = acc.T.astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16), grid=(1, n // bn),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("ablate_w4a16 needs a GPU: CPU timings prove nothing")
    k, n, m = 7168, 18432, 16
    key = jax.random.key(0)
    kq, ks, kx, kb = jax.random.split(key, 4)
    qweight = jax.random.randint(kq, (n, k // 4), -32768, 32767, jnp.int32).astype(jnp.int16)
    scale = jax.random.uniform(ks, (n, k // 32), jnp.float32, 0.005, 0.05).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w_bf16 = (jax.random.normal(kb, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
    wbytes_int4 = n * k // 2 + n * (k // 32) * 2

    timer = Timer(7)

    def measure(f, *a):  # device microseconds
        return timer(f, *a).device_s * 1e6

    meta = metadata(timer=timer.method, k=k, n=n, m=m)
    res = {"rows": []}

    def record(name, us, nbytes):
        res["rows"].append({"name": name, "us": us, "TBps": nbytes / (us * 1e-6) / 1e12})
        print(f"{name:70s} {us:8.1f} us  {nbytes / (us * 1e-6) / 1e12:5.2f} TB/s", flush=True)

    record("xla bf16 dot (bf16 bytes)", measure(jax.jit(lambda a, w: lax.dot_general(
        a, w, (((1,), (1,)), ((), ())))), x, w_bf16), n * k * 2)
    cfgs = [get_config(m, k, n)] + [
        BlockConfig(block_m=16, block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=st)
        for bn, bk, s, w, st in [(32, 256, 1, 4, 4), (64, 128, 1, 4, 5), (64, 256, 2, 4, 4), (64, 256, 1, 2, 4),
                                 (64, 256, 1, 4, 2), (32, 512, 1, 4, 3), (64, 512, 1, 4, 2), (32, 128, 1, 2, 6),
                                 (16, 512, 1, 2, 4)]]
    for cfg in cfgs:
        try:
            f = jax.jit(lambda a, q, s, cfg=cfg: w4a16_matmul(a, Int4Weight(q, s), impl="triton", config=cfg))
            record(f"w4a16 kernel {cfg}", measure(f, x, qweight, scale), wbytes_int4)
        except Exception as e:  # noqa: BLE001
            print("FAILED", cfg, type(e).__name__, str(e)[:150], flush=True)
    for bn, bk, warps, stages in [(64, 256, 4, 4), (128, 256, 4, 3), (64, 128, 4, 5), (128, 128, 4, 4)]:
        for name, w, nbytes in [("bf16 weights", w_bf16, n * k * 2), ("int16 words, no unpack", qweight, n * k // 2)]:
            try:
                f = jax.jit(functools.partial(skeleton, bn=bn, bk=bk, bm=16, warps=warps, stages=stages))
                xin = x if w.dtype == jnp.bfloat16 else x[:, : k // 4]
                record(f"skeleton {name} bn{bn} bk{bk} w{warps} st{stages}", measure(f, xin, w), nbytes)
            except Exception as e:  # noqa: BLE001
                print("FAILED skeleton", name, bn, bk, type(e).__name__, str(e)[:150], flush=True)
    md = [f"# What limits the W4A16 Triton kernel ({meta['device']}): K={k}, N={n}, M={m}", "",
          "| variant | us | TB/s |", "|---|---|---|"]
    md += [f"| {r['name']} | {r['us']:.1f} | {r['TBps']:.2f} |" for r in res["rows"]]
    write_results(os.path.join(args.out, "w4a16_ablation"), meta, res, "\n".join(md))


if __name__ == "__main__":
    main()
