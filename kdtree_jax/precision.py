"""The float32 matmul precisions the engine can run under (`jax_default_matmul_precision`, process-wide).

"highest" is how the engine runs float32 and where the greedy invariant (DDTree == autoregressive, token for token)
is proved; "default" leaves JAX's default (TF32 on NVIDIA GPUs: its rounding differs between a one-token step and a
tree-shaped verify, so greedy DDTree can leave the AR path at near-ties). The others are XLA dot algorithms
(`lax.DotAlgorithmPreset`): float32 accuracy from several bf16 or TF32 tensor-core passes, which XLA may run faster
than plain float32 FMAs on a GPU; XLA's CPU backend lacks the X9 and TF32 ones. Measured on the H200 (2026-12-03,
the shipped pair, batch 1 greedy, 8 held-out prompts x 128 tokens, benchmarks/results/e2e_h200_b1_s15_drafter8d*.md):
under BF16_BF16_F32_X9 DDTree at budget 31 ran 7370 tokens/s against 5812 under "highest", with greedy DDTree and
DFlash == AR on every prompt; the AR step itself was slower (2335 against 2701 tokens/s). The routed experts' XLA
forms, which otherwise name HIGHEST, follow an explicit algorithm
(pallas_kernels.moe_w4a16.reference.xla_dot_precision). Under an explicit algorithm a vector-shaped dot (a batch-1
AR step's projections, the routed experts' mat-vecs) runs at HIGHEST instead: XLA's GPU compiler rounds the products
of such a dot to bf16 under the algorithm (pallas_kernels.dots; the figures above predate that). With it, on an H100
(2026-12-05, benchmarks/results/e2e_h100_b1_s22_*.md, both precisions in one device call): AR 2513 against 2468
tokens/s under "highest", DDTree 15 5383 against 4413, greedy == AR on every prompt under both.
"""

from __future__ import annotations

MATMUL_PRECISIONS = ("highest", "default", "F32_F32_F32", "BF16_BF16_F32_X9", "BF16_BF16_F32_X6",
                     "BF16_BF16_F32_X3", "TF32_TF32_F32_X3")
CPU_LACKS = ("BF16_BF16_F32_X9", "TF32_TF32_F32_X3")


def set_matmul_precision(name: str, platform: str | None = None) -> None:
    """Apply one of MATMUL_PRECISIONS process-wide ("default": leave JAX's setting). With `platform` ("cpu", "gpu",
    ...), refuse up front a dot algorithm that backend lacks (instead of a compile error inside the first forward)."""
    import jax  # noqa: PLC0415 - importing this module must not start a backend

    if name not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision {name!r} is not one of {MATMUL_PRECISIONS}")
    if platform == "cpu" and name in CPU_LACKS:
        raise ValueError(f"matmul precision {name} is not available on the CPU (XLA's CPU backend lacks that dot "
                         f"algorithm); use one of {[p for p in MATMUL_PRECISIONS if p not in CPU_LACKS]}")
    if name != "default":
        jax.config.update("jax_default_matmul_precision", name)
