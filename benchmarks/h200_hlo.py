"""What XLA compiles the decode loops into for an H200, on a machine without one: per loop and matmul precision,
the dots and their precisions, and the products a float32 model rounds to bf16.

  python3.12 -m venv .venv-cuda && .venv-cuda/bin/pip install "jax[cuda12]==0.11.2" -e .
  .venv-cuda/bin/python benchmarks/h200_hlo.py --out benchmarks/results [--tag NAME] [--precisions ...]
  (or the venv of the project's aot extra, CUDA 13, which benchmarks/aot_resources.py uses: .venv-aot/bin/python)

A separate environment: the CUDA plugin (its compiler needs no GPU; 5.5 GB of CUDA wheels) makes every JAX start
try CUDA first, which the project's own CPU environment should not.

The shipped pair (float32, batch 1, one held-out prompt) runs through `kj.generate` for AR, DFlash and DDTree; the
one-jit loop each call would run is caught before it runs, compiled for an H200 target description (XLA's
deviceless compilation: JAX_PLATFORMS=cpu, the CUDA plugin's topology; this script sets both before JAX starts)
with the kernel choices an H200 would make (pallas_kernels.dispatch sees an H200), and its optimized HLO read:
  dots          the dot instructions left after XLA's rewrites, and how many of them carry an explicit algorithm
                or HIGHEST;
  bf16 products multiplies with a bf16 result: a float32 model has none of its own, so each is a product of a
                dot XLA split into bf16 pieces (an explicit algorithm) and then strength-reduced to multiply +
                reduce, rounded to bf16 (pallas_kernels/dots.py);
  kernels a round  the instructions of the loop's body that run as kernels (fusions, custom calls, copies; nested
                loops' bodies counted once): one round's launches, which bound a launch-bound model's round.
Nothing runs, so no timing: the same counts on the device need a GPU. Writes DIR/h200_hlo_<tag>.json/.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The H200 as XLA's GPU compiler sees it (se::GpuTargetConfigProto): the figures of an H200 SXM, compute 9.0.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""
H200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
BF16_PRODUCT = re.compile(r"= bf16\[[^\]]*\]\{[^}]*\} multiply\(")
DOT = re.compile(r" dot\(")


class Caught(Exception):
    """Raised in place of running a decode loop: the loop was compiled instead."""


COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")  # a computation's header line
OPCODE = re.compile(r"^(?:ROOT )?%[\w.\-]+ = .*? ([a-z][a-z\-]*)\(")
BODY = re.compile(r"body=%?([\w.\-]+)")  # a while loop's body
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")  # a conditional's branches
# Instructions that launch nothing (they name or reshape buffers); the rest of a computation's instructions after
# XLA's fusion each run as a kernel (fusions, custom calls, copies) or hold computations that do (while, conditional).
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier"}


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """({name: instruction lines}, the entry computation's name) of an HLO module's text."""
    bodies: dict[str, list[str]] = {}
    entry, name = "", None
    for line in text.splitlines():
        header = COMPUTATION.match(line)
        if header:
            name = header.group(2)
            bodies[name] = []
            entry = name if header.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name is not None and line.strip():
            bodies[name].append(line.strip())
    return bodies, entry


def kernels(bodies: dict[str, list[str]], name: str) -> int:
    """Kernel-running instructions of computation `name`, and of the loop bodies and conditional branches it holds
    (each counted once: a proxy for the launches of one pass)."""
    total = 0
    for line in bodies.get(name, []):
        opcode = OPCODE.match(line)
        if opcode is None or opcode.group(1) in NO_KERNEL:
            continue
        total += 1
        if opcode.group(1) in ("while", "conditional"):
            branches = BRANCHES.search(line)
            held = BODY.findall(line) + (re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else [])
            total += sum(kernels(bodies, sub) for sub in held)
    return total


def count(text: str) -> dict:
    """The counts this script reports, from an optimized HLO module's text; round_kernels: the kernel-running
    instructions of the decode loop's body (the entry computation's largest while loop), one round's launches."""
    dots = [line for line in text.splitlines() if DOT.search(line)]
    bodies, entry = computations(text)
    loops = [BODY.search(line) for line in bodies.get(entry, [])
             if (op := OPCODE.match(line)) is not None and op.group(1) == "while"]
    return {"dots": len(dots),
            "dots_algorithm": sum("algorithm=" in line for line in dots),
            "dots_highest": sum("operand_precision={highest,highest}" in line for line in dots),
            "bf16_products": len(BF16_PRODUCT.findall(text)),
            "round_kernels": max((kernels(bodies, m.group(1)) for m in loops if m), default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for h200_hlo_<tag>.*")
    ap.add_argument("--tag", default="shipped", help="suffix of the results files (default %(default)s)")
    ap.add_argument("--precisions", nargs="+", default=["highest", "BF16_BF16_F32_X9"],
                    help="float32 matmul precisions to compile under (kdtree_jax.precision; default %(default)s)")
    ap.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the shipped one)")
    ap.add_argument("--drafter", type=Path, default=None, help="drafter checkpoint (default: the shipped one)")
    # kdtree_jax.ddtree.DRAFTER_DTYPES, written out: importing it would start JAX before the environment below is set
    ap.add_argument("--drafter-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="the dtype the drafter computes in (kj.DFlashDraft compute_dtype; default: the target's, "
                         "float32). Its own bf16 products then count among the bf16 products")
    ap.add_argument("--budget", type=int, default=31, help="DDTree's tree budget (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="the held-out prompt's length (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=128, help="max_new_tokens of the loops (default %(default)s)")
    ap.add_argument("--dump-hlo", type=Path, default=None,
                    help="also write each loop's optimized HLO text into this folder (<loop>_<precision>.hlo.txt), "
                         "to read what a round launches")
    args = ap.parse_args()
    if "jax" in sys.modules:
        sys.exit("h200_hlo.py must set up JAX itself: run it as a script")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin then loads for compilation only (no device needed)
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # its version check would ask a driver for devices

    try:
        has_plugin = any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins package at all
        has_plugin = False
    if not has_plugin:
        sys.exit("h200_hlo.py needs a CUDA plugin: pip install 'jax[cuda12]==0.11.2', or the project's aot extra "
                 "(CUDA 13) in a venv of its own (no GPU needed)")
    import jax  # noqa: PLC0415 - after the environment above
    from jax._src.mesh import AbstractDevice  # noqa: PLC0415 - use_abstract_mesh's device (no public name)
    from jax.experimental import topologies  # noqa: PLC0415
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    import kdtree_jax as kj  # noqa: PLC0415
    from benchmarks.common import metadata, set_matmul_precision, shown_path, write_results  # noqa: PLC0415
    from pallas_kernels import dispatch  # noqa: PLC0415
    from training.prompts import load_prompts  # noqa: PLC0415

    dispatch.default_device = lambda: H200  # the kernel choices of an H200 (nothing here asks a real device)
    jax.default_backend = lambda: "gpu"  # the routed experts' XLA form as on a GPU (moe_w4a16.reference.xla_form)
    mesh = topologies.make_mesh(topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET,
                                                             topology="1x1x1"), (1,), ("x",))
    on_h200 = NamedSharding(mesh, PartitionSpec())
    abstract = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind=H200.device_kind, platform="gpu",
                                                                   num_cores=132))

    def catch(loop):
        def compile_instead(*call_args, **static):
            specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_h200), call_args)
            with jax.sharding.use_abstract_mesh(abstract):  # the Pallas Triton kernels lower for an H200 too
                lowered = loop.lower(*specs, **static)
            raise Caught(lowered.compile().as_text())
        return compile_instead

    for module, loop in (("kdtree_jax.generate", "_generate_ar"), ("kdtree_jax.ddtree", "_generate")):
        namespace = vars(importlib.import_module(module))  # (kj.generate is the function, not the module)
        namespace[loop] = catch(namespace[loop])

    target, drafter = args.target or kj.ASSETS / "target", args.drafter or kj.ASSETS / "drafter"
    cfg, params = kj.load_checkpoint(target, expect_kind="target", dtype="float32")
    dcfg, dparams = kj.load_checkpoint(drafter, expect_kind="drafter", dtype="float32")
    prompt = load_prompts(1, args.prompt_tokens)
    draft = kj.DFlashDraft(dcfg, dparams, compute_dtype=args.drafter_dtype)
    loops = {"AR": dict(method="ar"), "DFlash": dict(method="dflash", drafter=draft),
             f"DDTree {args.budget}": dict(method="ddtree", drafter=draft, tree_budget=args.budget)}
    rows = []
    for precision in args.precisions:
        set_matmul_precision(precision)
        for name, kwargs in loops.items():
            try:
                kj.generate(cfg, params, prompt, max_new_tokens=args.new_tokens, **kwargs)
                raise RuntimeError(f"{name}: generate ran instead of being caught")
            except Caught as caught:
                row = {"loop": name, "precision": precision, **count(str(caught))}
                if args.dump_hlo is not None:
                    args.dump_hlo.mkdir(parents=True, exist_ok=True)
                    (args.dump_hlo / f"{name.replace(' ', '_')}_{precision}.hlo.txt").write_text(str(caught))
            print(row, flush=True)
            rows.append(row)
        jax.clear_caches()

    pair = "The shipped pair" if args.target is None and args.drafter is None else (
        f"Target `{shown_path(target)}`, drafter `{shown_path(drafter)}` ({dcfg.num_hidden_layers} layers)")
    if args.drafter_dtype not in (None, "float32"):
        pair += f" (the drafter computing in {args.drafter_dtype}: its own products count among the bf16 products)"
    lines = ["# The decode loops compiled for an H200 (deviceless): dots and bf16-rounded products", "",
             f"{pair} in float32, batch 1, a {args.prompt_tokens}-token held-out prompt, {args.new_tokens} "
             "new tokens; each loop is one jitted program (its while body holds the round). Dots: dot instructions "
             "left in the optimized HLO (with an explicit algorithm / at HIGHEST); bf16 products: multiplies with a "
             "bf16 result, each a product XLA rounded to bf16 (a float32 model has none of its own); kernels a round: "
             "the instructions of the loop's body that run as kernels (fusions, custom calls, copies; nested loops' "
             "bodies once), a count of launches, not a time.", "",
             "| loop | precision | dots | with algorithm | HIGHEST | bf16 products | kernels a round |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['loop']} | {r['precision']} | {r['dots']} | {r['dots_algorithm']} | {r['dots_highest']} | "
              f"{r['bf16_products']} | {r['round_kernels']} |" for r in rows]
    meta = metadata(compiled_for="NVIDIA H200 (XLA deviceless compilation, target description in the script)",
                    target=shown_path(target), drafter=shown_path(drafter), budget=args.budget,
                    drafter_dtype=args.drafter_dtype or "float32",
                    prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    write_results(args.out / f"h200_hlo_{args.tag}", meta, {"rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
