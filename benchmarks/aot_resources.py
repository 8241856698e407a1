"""What ptxas makes of each Mosaic GPU kernel at K2 / K2.6 shapes, on a machine WITHOUT a GPU: registers a thread,
spill bytes, shared memory, and the SASS of the hot loops (instructions, wgmmas, local-memory spill loads/stores
inside each), by XLA's deviceless ahead-of-time compile for an abstract Hopper GPU.

  python benchmarks/aot_resources.py --out DIR [--gpu h100|h200] [--only tree_attention w4a16 moe]

How: the CUDA PJRT plugin (jax-cuda13-pjrt / jax-cuda13-plugin 0.11.2, the GPU image's) compiles for a topology
made from a target description (`TARGETS`: what XLA needs to know of the GPU) instead of a device; compiling a
Mosaic GPU custom call runs the whole Mosaic pipeline to PTX and ptxas (CUDA 13.0, the image's), and
MOSAIC_GPU_DUMP_TO makes it write the PTX and ptxas's report. The script then assembles that PTX again with the
same ptxas and disassembles it (nvdisasm) to find the loops. Then a launch census: whole engine calls (the attention
with its split combine, the routed MoE at T = 1) compiled the same way, and the kernels their optimized HLO launches,
XLA glue included. Nothing runs: these are compile-time facts (the register allocation, the spills, the instruction
mix of a loop, the launches of a call), never timings.

Set-up, in a virtual environment of its own (with the CUDA plugin installed every `import jax` looks for a GPU, which
the test environment should not):
  python3.12 -m venv .venv-aot && .venv-aot/bin/pip install -e '.[aot]'
  .venv-aot/bin/python benchmarks/aot_resources.py --out benchmarks/results
The `aot` extra brings the plugin, ptxas (nvidia-cuda-nvcc 13.0) and nvdisasm; MOSAIC_GPU_CUDA_ROOT overrides where
the CUDA tools are looked for. Writes DIR/aot_resources_<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What XLA's GPU compiler needs to know of the target (a GpuTargetConfigProto in text form); the values are the
# GPUs' published ones (132 SMs, 227 KiB of opt-in SMEM a block, 64 K registers an SM). Both are sm_90a: the same
# code, the same registers; only memory size and bandwidth differ.
_HOPPER = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  device_address_bits: 64
  name: "{name}"
  driver_version: "13.0.0"
  runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
  dnn_version: "9.10.0"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
}}
device_description_str: "{name}"
"""
TARGETS = {
    "h100": _HOPPER.format(name="NVIDIA H100 80GB HBM3", bandwidth=3352320000000, l2=52428800, memory=84942979072),
    "h200": _HOPPER.format(name="NVIDIA H200", bandwidth=4800000000000, l2=62914560, memory=150754820096),
}


# --------------------------------------------------------------------------------------------- the reports
@dataclasses.dataclass
class PtxasReport:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    barriers: int | None


def parse_ptxas(text: str) -> PtxasReport:
    """ptxas -v's report of one kernel: registers a thread, spill bytes, stack frame, named barriers."""
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    bars = re.search(r"used (\d+) barriers", text)
    if regs is None or spills is None:
        raise ValueError(f"not a ptxas -v report of one kernel:\n{text}")
    return PtxasReport(int(regs.group(1)), int(spills.group(1)), int(spills.group(2)),
                       int(stack.group(1)) if stack else 0, int(bars.group(1)) if bars else None)


@dataclasses.dataclass
class Loop:
    start: int  # byte offsets in the kernel's SASS
    end: int
    instructions: int
    wgmma: int
    spill_loads: int
    spill_stores: int
    exp2: int
    opcodes: dict[str, int]  # the loop's instructions by opcode (predicates dropped), most frequent first


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


def sass_loops(sass: str) -> list[Loop]:
    """The innermost loops of one kernel's SASS (`nvdisasm -c`) that hold wgmmas (HGMMA): a backward branch
    closes a loop from its target to itself, unless that range holds an EXIT (the out-of-line retry blocks of
    the barrier waits, placed after the kernel's end, branch back into it: they are not loops); of those with
    wgmmas, the ones with no such loop inside."""
    instrs: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _INSTR.match(line):
            addr = int(m.group(1), 16)
            instrs.append((addr, m.group(2)))
            for name in pending:
                labels[name] = addr
            pending = []

    def count(lo: int, hi: int, pattern: str) -> int:
        return sum(1 for a, text in instrs if lo <= a <= hi and re.search(pattern, text))

    candidates = set()
    for addr, text in instrs:
        m = _BRANCH.search(text)
        if m and (target := labels.get(m.group(1))) is not None and target < addr:
            if not count(target, addr, r"\bEXIT\b") and count(target, addr, r"\bHGMMA\b"):
                candidates.add((target, addr))
    innermost = [(lo, hi) for lo, hi in candidates
                 if not any((lo2, hi2) != (lo, hi) and lo <= lo2 and hi2 <= hi for lo2, hi2 in candidates)]

    def opcodes(lo: int, hi: int) -> dict[str, int]:
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for a, text in instrs if lo <= a <= hi)
        return dict(ops.most_common())

    return [Loop(lo, hi, count(lo, hi, "."), count(lo, hi, r"\bHGMMA\b"), count(lo, hi, r"\bLDL\b"),
                 count(lo, hi, r"\bSTL\b"), count(lo, hi, r"\bMUFU\.EX2\b"), opcodes(lo, hi))
            for lo, hi in sorted(innermost)]


# ------------------------------------------------------------------------------------------ the tooling
def cuda_root() -> Path:
    """Where ptxas, nvdisasm and libdevice are: MOSAIC_GPU_CUDA_ROOT, else the `aot` extra's pip packages
    (nvidia/cu13), else /usr/local/cuda."""
    if root := os.environ.get("MOSAIC_GPU_CUDA_ROOT"):
        return Path(root)
    try:
        import nvidia.cu13  # pyright: ignore[reportMissingImports] (the aot extra)

        return Path(list(nvidia.cu13.__path__)[0])
    except ImportError:
        return Path("/usr/local/cuda")


def tool(root: Path, name: str) -> str:
    """The path of a CUDA tool: root/bin/name, else on PATH; a clear error without it."""
    for candidate in (root / "bin" / name, shutil.which(name)):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit(f"aot_resources: no {name} in {root}/bin or on PATH (install the aot extra: "
                     "pip install -e '.[aot]', or set MOSAIC_GPU_CUDA_ROOT)")


def setup_environment(dump_dir: str) -> None:
    """Before jax is imported: the CUDA plugin skips its library checks (no cuDNN is needed to compile), jax
    keeps the CPU as its backend, Mosaic writes what it compiles to dump_dir, libdevice and ptxas come from
    cuda_root()."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump_dir
    os.environ.setdefault("MOSAIC_GPU_CUDA_ROOT", str(cuda_root()))


def abstract_device(gpu: str):
    """The one device of a deviceless topology for this GPU (XLA's AOT compile for a target description)."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=TARGETS[gpu],
                                            topology="1x1x1")
    except (NotImplementedError, RuntimeError, KeyError) as e:
        raise SystemExit(f"aot_resources: no CUDA topology ({e}); this needs the CUDA plugin of the aot extra: "
                         "pip install -e '.[aot]' in a virtual environment of its own") from e
    return topo.devices[0]


@dataclasses.dataclass
class Case:
    kernel: str  # tree_attention | w4a16 | moe
    name: str
    build: Callable  # () -> (fn, abstract args without sharding)
    donate: tuple[int, ...] = ()  # arguments the compiled call may update in place (an engine's latent cache)


def compile_for(case: Case, device):
    """The case's function compiled for the abstract device (its arguments placed there)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    fn, args = case.build()
    sharding = SingleDeviceSharding(device)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    return jax.jit(fn, donate_argnums=case.donate).trace(*args).lower().compile()


def compile_case(case: Case, device, dump_dir: Path, ptxas: str, nvdisasm: str) -> dict:
    """Compile one kernel for the abstract device; its ptxas report, SMEM, hot loops. Exactly one Mosaic module
    must appear in dump_dir (one kernel a case)."""
    before = set(glob.glob(str(dump_dir / "*.ptx")))
    t0 = time.time()
    try:
        compile_for(case, device)
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a result: reported, not raised
        return {"kernel": case.kernel, "case": case.name, "error": str(e).strip().splitlines()[0][:300]}
    new = sorted(set(glob.glob(str(dump_dir / "*.ptx"))) - before)
    if len(new) != 1:
        raise RuntimeError(f"{case.name}: expected one Mosaic module, found {len(new)} PTX files")
    stem = Path(new[0]).with_suffix("")
    report = parse_ptxas(Path(f"{stem}.ptxas").read_text())
    smem = re.search(r"smem_scratch_bytes=(\d+)", Path(f"{stem}.resources.txt").read_text())
    # the SASS: the same PTX through the same ptxas (its register count must agree with Mosaic's own compile)
    cubin = f"{stem}.cubin"
    again = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", f"{stem}.ptx", "-o", cubin],
                           capture_output=True, text=True, check=True)
    if parse_ptxas(again.stderr + again.stdout).registers != report.registers:
        raise RuntimeError(f"{case.name}: ptxas run again gave another register count than Mosaic's compile")
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    loops = sass_loops(sass)
    for path in glob.glob(f"{stem}.*"):  # the pass log alone is ~100 MB a kernel
        os.remove(path)
    return {"kernel": case.kernel, "case": case.name, **dataclasses.asdict(report),
            "smem_bytes": int(smem.group(1)) if smem else None,
            "sass_instructions": sum(1 for line in sass.splitlines() if _INSTR.match(line)),
            "loops": [dataclasses.asdict(loop) for loop in loops], "compile_s": round(time.time() - t0, 1)}


# -------------------------------------------------------------------------------------------- the kernels
def _cache_rows(T: int, s: int) -> int:
    """The cache rows an engine allocates for s committed rows and T tree tokens: s + T rounded up to 64."""
    return -(-(s + T) // 64) * 64


def _k2_attention(T: int, s: int, config):
    """(fn, abstract args): `tree_attention_mosaic` at K2's MLA shape (H 64, c 512, r 64, bf16, B 1), s committed
    rows, T tree tokens, with this MosaicAttentionConfig."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.tree_attention.mosaic_gpu import tree_attention_mosaic

    S = jax.ShapeDtypeStruct
    c, r, h = 512, 64, 64
    args = (S((1, T, h, c + r), jnp.bfloat16), S((1, _cache_rows(T, s), c + r), jnp.bfloat16), S((1,), jnp.int32),
            S((1, T, T), jnp.bool_))

    def fn(q, cache, start, mask):
        return tree_attention_mosaic(q, cache, start, mask, scale=0.04, value_dim=c, config=config)
    return fn, args


def _expert_stack(n: int, k: int):
    """Abstract int4 [E, N, K] weights and bf16 [E, K/32, N] scales of K2.6's 384 routed experts (the Mosaic layout)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.int4 import GROUP_SIZE

    experts = 384
    return (jax.ShapeDtypeStruct((experts, n, k), jnp.int4),
            jax.ShapeDtypeStruct((experts, k // GROUP_SIZE, n), jnp.bfloat16))


def cases(only: list[str]) -> list[Case]:
    """The kernels at the shapes the engine runs them: tree attention at K2's MLA shape (H 64, c 512, r 64, bf16,
    S = 32768) with the tuned split count and schedule of each T and the other schedule; the dense W4A16 GEMM at
    K2.6's dense MLP and expert widths with its tuned tiling (M 8: a decode step); the grouped MoE launches at
    K2.6's experts (384 x [2048, 7168]; a decode step's 8 tiles: gate and up reading x's one row, down 8 rows a
    tile)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.int4 import GROUP_SIZE
    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_gate_up_mgpu_kernel, grouped_w4a16_mgpu_kernel
    from pallas_kernels.moe_w4a16.tuned import default_mosaic_config
    from pallas_kernels.tree_attention import tuned as attention_tuned
    from pallas_kernels.w4a16.mosaic_gpu import w4a16_matmul_mgpu_kernel
    from pallas_kernels.w4a16.tuned import dense_config

    S = jax.ShapeDtypeStruct
    out: list[Case] = []
    if "tree_attention" in only:
        for T in (1, 33, 129):
            tuned = attention_tuned.mosaic_config(batch=1, num_tree=T, cache_rows=32768)
            other = "shared_qk" if tuned.schedule == "replicated" else "replicated"
            for config in (tuned, dataclasses.replace(tuned, schedule=other)):
                label = f"T={T} S=32768 {config.schedule} splits={config.num_splits}" + (
                    " (tuned)" if config is tuned else "")
                out.append(Case("tree_attention", label, lambda T=T, config=config: _k2_attention(T, 32768, config)))

    def dense(k: int, n: int, m: int):
        config, split, whole = dense_config(k, n)
        args = (S((m, k), jnp.bfloat16), S((n, k), jnp.int4), S((k // GROUP_SIZE, n), jnp.bfloat16))
        return (lambda x, w, s: w4a16_matmul_mgpu_kernel(x, w, s, config=config, split_k=split,
                                                         whole_tiles=whole)), args

    if "w4a16" in only:
        for k, n in ((7168, 18432), (18432, 7168), (7168, 2048), (2048, 7168)):
            config, split, whole = dense_config(k, n)
            out.append(Case("w4a16", f"K={k} N={n} M=8 block_k={config.block_k} split_k={split}"
                            + (f" whole_tiles={whole}" if whole else ""),
                            lambda k=k, n=n: dense(k, n, 8)))

    def grouped(k: int, n: int, tiles: int, fused: bool, rows: int):  # rows: x's (1: every tile reads that one)
        config = default_mosaic_config(k)
        x = S((rows, k), jnp.bfloat16)
        w, s = _expert_stack(n, k)
        tile_expert = S((tiles,), jnp.int32)
        if fused:
            return (lambda x, gw, gs, uw, us, t: grouped_gate_up_mgpu_kernel(x, gw, gs, uw, us, t, config=config),
                    (x, w, s, w, s, tile_expert))
        return (lambda x, w, s, t: grouped_w4a16_mgpu_kernel(x, w, s, t, config=config)), (x, w, s, tile_expert)

    if "moe" in only:  # the kernel's code does not depend on the tile count (a grid dimension): T = 1's 8 tiles, as
        # the decode step runs them (gate / up reading x's one row as every tile's token tile, down 8 rows a tile)
        out.append(Case("moe", "gate or up, K=7168 N=2048, 8 tiles reading x's 1 row",
                        lambda: grouped(7168, 2048, 8, False, 1)))
        out.append(Case("moe", "fused gate+up, K=7168 N=2048, 8 tiles reading x's 1 row",
                        lambda: grouped(7168, 2048, 8, True, 1)))
        out.append(Case("moe", "down, K=2048 N=7168, 8 tiles of 8 rows", lambda: grouped(2048, 7168, 8, False, 64)))
    return out


# ------------------------------------------------------------------------------------------ the census
_LAUNCH = re.compile(r"^\s*(?:ROOT )?%(\S+) = .+? (fusion|custom-call)\(.*?(?:kind=(\w+)|custom_call_target=\"(\w+)\")")


_WHILE = re.compile(r"^\s*(?:ROOT )?%(\S+) = .+? while\(")


def launches(hlo: str) -> list[str]:
    """The kernels one compiled program launches, in order: the fusions and custom calls of its optimized HLO's
    entry computation ("fusion <name> (<kind>)", "custom-call <target>"), and its while loops ("while <name>": each
    trip launches its body's kernels again, and on a GPU the condition goes back to the host). (A fusion can hold a
    library call; the programs counted here have none.)"""
    entry = hlo[hlo.index("ENTRY"):]
    out = []
    for line in entry.splitlines():
        if m := _LAUNCH.match(line):
            name, op, kind, target = m.groups()
            out.append(f"custom-call {target}" if op == "custom-call" else f"fusion {name} ({kind})")
        elif m := _WHILE.match(line):
            out.append(f"while {m.group(1)}")
    return out


def census_cases() -> list[Case]:
    """Whole engine calls, with their XLA glue: the tree attention as the dispatcher runs it on Hopper
    (`tree_attention_mosaic` with the tuned split count and schedule: mask words, the kernel, the split combine; the
    entry point itself refuses the CPU that compiles) at T = 1 / 33, S = 32768, the routed MoE of one K2.6 layer
    (E 384, top-8, 7168 -> 2048 -> 7168) at T = 1 and 9, in three launches and with gate / up fused, XLA's attention
    (what runs at T = 1, S = 4096) over one layer of a whole two-layer cache, as the model calls it, and a whole K2.6
    MoE decoder layer at T = 1 and 9, S = 4096 as the engine runs it on Hopper (the model traced with the
    dispatcher's choices for an H100: `_dispatching_for_hopper`)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.int4 import MosaicInt4Weight
    from pallas_kernels.moe_w4a16.mosaic_gpu import grouped_moe_w4a16_mgpu
    from pallas_kernels.tree_attention import tuned as attention_tuned

    S = jax.ShapeDtypeStruct
    out: list[Case] = []
    for T in (1, 33):
        config = attention_tuned.mosaic_config(batch=1, num_tree=T, cache_rows=_cache_rows(T, 32768))
        out.append(Case("attention call", f"T={T} S=32768",
                        lambda T=T, config=config: _k2_attention(T, 32768, config)))

    def moe(T: int, fused: bool):
        d, i, k = 7168, 2048, 8

        def fn(x, gw, gs, uw, us, dw, ds, ids, wts):
            stack = {"gate": MosaicInt4Weight(gw, gs), "up": MosaicInt4Weight(uw, us),
                     "down": MosaicInt4Weight(dw, ds)}
            return grouped_moe_w4a16_mgpu(x, stack, ids, wts, fused_gate_up=fused)

        return fn, (S((T, d), jnp.bfloat16), *_expert_stack(i, d), *_expert_stack(i, d), *_expert_stack(d, i),
                    S((T, k), jnp.int32), S((T, k), jnp.float32))

    for T in (1, 9):  # a decode step (one tile a choice) and a verify (the grouped path); fused is the default
        for fused in (False, True):
            out.append(Case("routed MoE call", f"T={T}, {'gate+up fused' if fused else 'three launches'}"
                            + (", the grouped path" if T > 1 else ""), lambda T=T, fused=fused: moe(T, fused)))

    def xla_attention(T: int, rows: int):  # XLA's form over one layer of the engine's whole [L, B, S, C] cache
        from pallas_kernels.tree_attention.reference import tree_mla_attention_xla

        def fn(q, cache, start, mask):
            return tree_mla_attention_xla(q, cache[1], start, mask, scale=0.04, value_dim=512)

        return fn, (S((1, T, 64, 576), jnp.bfloat16), S((2, 1, rows, 576), jnp.bfloat16),
                    S((1,), jnp.int32), S((1, T, T), jnp.bool_))

    def dense(m: int, k: int, n: int):  # the dense W4A16 call as the model's INT4 linears run it on Hopper
        from pallas_kernels.w4a16 import w4a16_matmul

        def fn(x, w, s):
            with _dispatching_for_hopper():
                return w4a16_matmul(x, MosaicInt4Weight(w, s))

        return fn, (S((m, k), jnp.bfloat16), S((n, k), jnp.int4), S((k // 32, n), jnp.bfloat16))

    for m in (1, 8):  # a decode step's one row (the kernel reads it as an 8-row tile, no pad) and a full tile
        out.append(Case("dense W4A16 call", f"K=7168 N=2048 M={m}", lambda m=m: dense(m, 7168, 2048)))
    # 4096 cache rows exactly: at other counts (4160) XLA also pads the value GEMM's operand for its split-K
    out.append(Case("attention call", "XLA, T=1 S=4096, layer 1 of 2", lambda: xla_attention(1, 4096)))
    for T in (1, 9):  # an AR step's layer and a budget-8 verify's
        out.append(Case("decoder layer", f"K2.6 MoE layer, T={T} S=4096, as the engine runs it on Hopper",
                        lambda T=T: _k26_layer(T, 4096), donate=(3,)))
    return out


_HOPPER = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3",
                                core_count=132)  # what the dispatcher asks of a device, for choices made while tracing


@contextlib.contextmanager
def _dispatching_for_hopper():
    """While a function is traced on this GPU-less machine: the dispatcher's default device is a Hopper GPU, so the
    model makes the choices it makes on one (the Mosaic MoE, the tuned attention, the GPU weight layouts)."""
    from pallas_kernels import dispatch

    saved = dispatch.default_device
    dispatch.default_device = lambda: _HOPPER
    try:
        yield
    finally:
        dispatch.default_device = saved


def _k26_layer(T: int, rows: int):
    """One K2.6 MoE decoder layer (the model's `DecoderLayer`, bf16, INT4 routed experts) on its params as
    `kj.prepare_params` lays them out for a Hopper GPU (the router in bf16, as it keeps a checkpoint's) and `generate`
    then folds them (`model.fold_params`: at K2.6 W_UK and W_UV by head), writing its T rows into a one-layer latent
    cache of `rows` rows (donated: written in place, as in the engine's loop)."""
    import jax
    import jax.numpy as jnp

    import kdtree_jax as kj
    from kdtree_jax.model import DecoderLayer, fold_params

    cfg = kj.ModelConfig.kimi_k26().replace(num_hidden_layers=1, first_k_dense_replace=0)
    kernels = kj.Kernels()
    with _dispatching_for_hopper():
        params = jax.eval_shape(lambda k: fold_params(kj.prepare_params(
            kj.quantize(kj.init_params(cfg, k, jnp.bfloat16), cfg), cfg, kernels, device=_HOPPER), cfg, kernels),
            jax.random.key(0))
    # a K2.6 checkpoint's router holds bf16 values, which prepare_params keeps in bf16 (kernels.prepare_routers: it
    # reads values, which an abstract tree has not)
    router = params["layers_0"]["moe"]["router"]
    params["layers_0"]["moe"]["router"] = jax.ShapeDtypeStruct(router.shape, jnp.bfloat16)

    def fn(layer_params, h, positions, cache, start, visibility):
        with _dispatching_for_hopper():
            return DecoderLayer(cfg, 0, jnp.bfloat16, kernels).apply({"params": layer_params}, h, positions, cache,
                                                                     start, visibility)

    S = jax.ShapeDtypeStruct
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return fn, (params["layers_0"], S((1, T, cfg.hidden_size), jnp.bfloat16), S((1, T), jnp.int32),
                S((1, 1, rows, width), jnp.bfloat16), S((1,), jnp.int32), S((1, T, T), jnp.bool_))


def compile_launches(case: Case, device) -> dict:
    """One engine call compiled for the abstract device: the kernels it launches."""
    hlo = compile_for(case, device).as_text()
    if hlo is None:
        raise RuntimeError(f"{case.name}: the compiled program has no HLO text")
    found = launches(hlo)
    return {"call": case.kernel, "case": case.name, "launches": found}


# --------------------------------------------------------------------------------------------------- main
def markdown(rows: list[dict], gpu: str, tools: str = "", opcodes: int = 0, census: list[dict] | None = None) -> str:
    """The table of `rows`; then the launches of each `census` call; with opcodes > 0, each hot loop's most
    frequent opcodes (that many)."""
    lines = [f"# ptxas resources of the Mosaic GPU kernels (deviceless compile for an abstract {gpu.upper()}, sm_90a)",
             "", *([tools, ""] if tools else []),
             "Compile-time facts, not timings: registers a thread (255 is the most a thread can have), spill bytes "
             "(ptxas -v), SMEM (Mosaic's scratch), and each innermost loop holding wgmmas (HGMMA) in the SASS: its "
             "instructions, wgmmas, exp2s, and local-memory spill loads / stores (LDL / STL) inside it.", "",
             "| kernel | case | regs | spill st / ld B | SMEM KiB | SASS instr "
             "| hot loops: instr, HGMMA, EX2, LDL / STL |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['kernel']} | {row['case']} | does not compile: {row['error']} | | | | |")
            continue
        loops = "; ".join(f"{lp['instructions']}, {lp['wgmma']}, {lp['exp2']}, "
                          f"{lp['spill_loads']} / {lp['spill_stores']}" for lp in row["loops"]) or "none"
        smem = f"{row['smem_bytes'] / 1024:.1f}" if row["smem_bytes"] is not None else "?"
        lines.append(f"| {row['kernel']} | {row['case']} | {row['registers']} | {row['spill_store_bytes']} / "
                     f"{row['spill_load_bytes']} | {smem} | {row['sass_instructions']} | {loops} |")
    if census:
        lines += ["", "Kernels launched by one engine call (its optimized HLO: Mosaic kernels are `custom-call "
                  "mosaic_gpu_v2`, the rest XLA fusions):", "",
                  "| call | case | launches | of them XLA | the launches |", "| --- | --- | --- | --- | --- |"]
        for row in census:
            xla = sum(1 for launch in row["launches"] if launch.startswith("fusion"))
            lines.append(f"| {row['call']} | {row['case']} | {len(row['launches'])} | {xla} | "
                         f"{'; '.join(row['launches'])} |")
    if opcodes:
        lines += ["", f"The hot loops' {opcodes} most frequent opcodes (instructions a warp issues per iteration):", ""]
        for row in rows:
            for i, lp in enumerate(row.get("loops", [])):
                top = ", ".join(f"{op} {n}" for op, n in list(lp["opcodes"].items())[:opcodes])
                lines.append(f"- {row['kernel']}, {row['case']}, loop {i + 1} ({lp['instructions']}): {top}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"),
                    help="folder for aot_resources_<gpu>.json / .md")
    ap.add_argument("--gpu", choices=sorted(TARGETS), default="h100",
                    help="the abstract target (both sm_90a: the same code and registers)")
    ap.add_argument("--only", nargs="+", choices=("tree_attention", "w4a16", "moe"),
                    default=["tree_attention", "w4a16", "moe"], help="which kernels (default: all)")
    ap.add_argument("--tag", default="", help="suffix of the results' file names")
    ap.add_argument("--opcodes", type=int, default=12, help="list this many of each hot loop's most frequent opcodes")
    ap.add_argument("--no-census", action="store_true",
                    help="skip the launch census (the kernels one engine call launches: attention T = 1 / 33, the "
                         "routed MoE at T = 1)")
    args = ap.parse_args(argv)

    dump = tempfile.mkdtemp(prefix="kdtree_aot_")
    setup_environment(dump)
    from tqdm import tqdm

    from benchmarks.common import metadata, write_results

    root = cuda_root()
    ptxas, nvdisasm = tool(root, "ptxas"), tool(root, "nvdisasm")
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    ptxas_version = re.search(r"V[\d.]+", version)
    device = abstract_device(args.gpu)
    rows = []
    try:
        for case in tqdm(cases(args.only), desc="compiling", unit="kernel"):
            rows.append(compile_case(case, device, Path(dump), ptxas, nvdisasm))
            tqdm.write(markdown(rows[-1:], args.gpu).splitlines()[-1])
        census = []
        for case in tqdm([] if args.no_census else census_cases(), desc="launch census", unit="call"):
            census.append(compile_launches(case, device))
            tqdm.write(f"{case.kernel}, {case.name}: {len(census[-1]['launches'])} launches")
            for path in glob.glob(f"{dump}/*"):  # Mosaic's dumps of these compiles (~100 MB a kernel)
                os.remove(path)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    from importlib.metadata import version as package_version

    meta = metadata(target=device.device_kind + " (abstract: a deviceless compile, nothing ran)",
                    ptxas=ptxas_version.group(0) if ptxas_version else version.strip().splitlines()[-1],
                    cuda_plugin=package_version("jax-cuda13-pjrt"))
    tools = (f"Target {meta['target']}; ptxas {meta['ptxas']}; jax-cuda13-pjrt {meta['cuda_plugin']} (the GPU image's "
             "versions). The machine that compiled has no GPU.")
    stem = Path(args.out) / f"aot_resources_{args.gpu}{'_' + args.tag if args.tag else ''}"
    write_results(stem, meta, {"rows": rows, "census": census},
                  markdown(rows, args.gpu, tools, opcodes=args.opcodes, census=census))


if __name__ == "__main__":
    main()
