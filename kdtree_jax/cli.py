"""The `kdtree-jax` command line: generate, convert, init, info, verify.

    kdtree-jax generate --shipped --prompt "def fibonacci(n):" --method all
    kdtree-jax generate --preset tiny --prompt "1 2 3" --method all
    kdtree-jax convert /models/Kimi-K2.6 /ckpt/k26 --dtype bfloat16
    kdtree-jax init /ckpt/tiny --preset tiny; kdtree-jax init /ckpt/tiny-drafter --drafter --target /ckpt/tiny
    kdtree-jax info /ckpt/k26
    kdtree-jax verify /ckpt/k26

`main(argv)` returns the exit status (0 ok, 2 error, 130 interrupted). Every error is one line on
stderr, `kdtree-jax: error: ...`, without a traceback (`--traceback` shows one, for bug reports).
`generate` also reports its steps there (`kdtree-jax: compiling ddtree ... 12.3 s`); results go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# the limits --help states (importing the package already loaded these modules)
from kdtree_jax import ASSETS
from kdtree_jax.budget import rounds_per_budget
from kdtree_jax.ddtree import DRAFTER_DTYPES, MAX_TREE_BUDGET, DFlashDraft
from kdtree_jax.drafter import MAX_BLOCK_SIZE
from kdtree_jax.precision import MATMUL_PRECISIONS, set_matmul_precision

PROG = "kdtree-jax"
PRESETS = ("tiny",)  # models small enough to build from random weights on any machine
DTYPES = ("bfloat16", "float32", "float16")
METHODS = ("ar", "dflash", "ddtree", "all")
DEFAULT_BUDGET = "auto"
# jax.random.key keeps the low 32 bits of a seed (64-bit ints are off): 2**32 would give seed 0's numbers.
MAX_SEED = 2**32 - 1
# The implementations `--moe-kernel` etc. accept: pallas_kernels.dispatch.IMPLS (not imported here: start-up time).
KERNEL_CHOICES = {"attention": ("mosaic_gpu", "xla"), "linear": ("mosaic_gpu", "xla"),
                  "moe": ("triton", "mosaic_gpu", "xla"), "tree": ("triton", "xla"),
                  "mla": ("folded", "separate")}


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Status:
    """What a slow command is doing, on stderr: `kdtree-jax: compiling ddtree ... 12.3 s`.

    A step's line stays open while it runs; a note, a progress bar or an error printed meanwhile closes
    it first (`close`), and the time then gets a line of its own."""

    def __init__(self):
        self.open = False

    def close(self) -> None:
        if self.open:
            print(file=sys.stderr, flush=True)
            self.open = False

    @contextlib.contextmanager
    def step(self, what: str):
        """Yields a dict whose "seconds" is set when the step ends."""
        self.close()
        print(f"{PROG}: {what} ...", end="", file=sys.stderr, flush=True)
        self.open, timing, start = True, {}, time.perf_counter()
        try:
            yield timing
        except BaseException:
            self.close()
            raise
        timing["seconds"] = seconds = time.perf_counter() - start
        took = f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"
        if self.open:
            print(f" {took}", file=sys.stderr, flush=True)
            self.open = False
        else:
            print(f"{PROG}: {what}: {took}", file=sys.stderr, flush=True)


STATUS = _Status()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message and exits; we want one line
        raise CLIError(f"{message} (see '{self.prog} --help')")


# ------------------------------------------------------------------------------------------ parser
def _seed(text: str) -> int:
    """--seed: an integer JAX can take as a key without aliasing another seed."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {MAX_SEED}] (JAX keys take 32-bit seeds: "
                                         f"a larger one would repeat a smaller one's numbers), got {text}")
    return seed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="DeepSeek-V3 / Kimi K2.x inference in JAX with DDTree speculative "
                     "decoding and INT4 weights.")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, show the Python traceback instead of the one-line message")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate tokens from a checkpoint, an HF directory or a preset",
                       description="Generate continuations of one or more prompts and print the tokens (text "
                       "with --tokenizer) and the acceptance statistics. Give exactly one model source.")
    src = g.add_argument_group("model (exactly one)")
    src.add_argument("--checkpoint", metavar="DIR", help="a kdtree-jax Orbax checkpoint written by "
                     "'convert' or 'init'")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face DeepSeek-V3 / Kimi K2.x checkpoint directory "
                     "(loaded whole into memory: convert big models once instead)")
    src.add_argument("--preset", choices=PRESETS, help="random weights (from --seed) of a built-in config; "
                     "without --drafter a random drafter is made too")
    src.add_argument("--shipped", action="store_true", help="the shipped pair: a small K2.6-architecture "
                     "target (INT4 experts) trained on Python's standard library, its trained DFlash drafter and "
                     "tokenizer (prompts are Python text)")
    src.add_argument("--layers", type=int, metavar="N", help="with --preset: number of decoder layers "
                     "(default: the preset's)")
    g.add_argument("--drafter", metavar="DIR", help="a drafter checkpoint (needed by dflash / ddtree unless "
                   "--preset; 'init --drafter' writes a random one)")
    g.add_argument("--hf-drafter", metavar="DIR", help="instead of --drafter: a z-lab DFlash drafter directory "
                   "(config.json with dflash_config + safetensors, e.g. Kimi-K2.5-DFlash), loaded in the "
                   "target's dtype and checked against the target (docs/drafter.md)")
    g.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt: space-separated token ids, "
                   "or text when --tokenizer is given. Repeat for a batch (default: the BOS token)")
    g.add_argument("--tokenizer", metavar="FILE", help="a tokenizer.json (Hugging Face 'tokenizers' format): "
                   "prompts are text and the output is decoded, prompt included")
    g.add_argument("--no-heal", action="store_true", help="use text prompts exactly as encoded. By default "
                   "(token healing) each text prompt's last token is removed and generated again, the first new "
                   "token restricted to tokens that start with the removed text, so that a prompt may end "
                   "anywhere (after a newline, inside indentation or a word) and continue as the training text "
                   "did; needs a byte-level BPE tokenizer (others: a note, and no healing)")
    g.add_argument("--method", choices=METHODS, default="ar", help="ar: autoregressive; dflash: single-path "
                   "speculative; ddtree: tree speculative; all: run each and compare (default: %(default)s)")
    g.add_argument("--budget", type=_budget, metavar="N|auto", help="DDTree tree budget: draft nodes verified "
                   f"per round, 1 to {MAX_TREE_BUDGET}, or auto: each round verifies the budget with the most expected "
                   "tokens per unit of round cost, from the drafter's scores and round costs measured for this "
                   "device kind; on a CPU rounds also skip the draft (an AR step) while drafting cannot pay "
                   f"(docs/ddtree.md, 'Auto budget'; default: {DEFAULT_BUDGET})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, metavar="K", help="sample only from the K most likely tokens")
    g.add_argument("--top-p", type=float, metavar="P", help="sample only from the smallest set of tokens "
                   "with probability mass >= P")
    g.add_argument("--seed", type=_seed, default=0, help="PRNG seed for sampling and for --preset weights, "
                   f"0 to {MAX_SEED} (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate per "
                   "prompt (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, help="weight dtype (default: bfloat16 for --hf, float32 for "
                   "--preset, float32 for --shipped, the stored one for --checkpoint; with a checkpoint the dense "
                   "weights are cast after loading, INT4 experts stay INT4)")
    g.add_argument("--drafter-dtype", choices=DRAFTER_DTYPES, help="the dtype the drafter computes in (default: the "
                   "target's). Only the target decides what a greedy verify commits, so a float32 target keeps "
                   "greedy DDTree == AR with a bfloat16 drafter (the dtype the shipped drafter trained in). On a "
                   "GPU, bfloat16 is the faster choice: the shipped drafter ran 1.5-2.5%% faster end to end in it at "
                   "the same acceptance (an H100, docs/ddtree.md)")
    g.add_argument("--stop", type=int, action="append", metavar="ID", help="a stop token id (repeatable; "
                   "default: the config's eos_token_id)")
    g.add_argument("--mesh", metavar="SPEC", help="run the target sharded over a device mesh, e.g. "
                   "'expert=2,tensor=1' (axes expert and tensor; uses the first expert*tensor devices; "
                   "docs/sharding.md)")
    g.add_argument("--no-verify", action="store_true", help="skip checking each tensor of --checkpoint / "
                   "--drafter against the sha256 recorded when it was written (for trusted storage; checking "
                   "reads every byte once more)")
    g.add_argument("--no-warmup", action="store_true", help="time the first call (compile time included) "
                   "instead of a second, compiled one")
    g.add_argument("--moe-kernel", choices=("auto", *KERNEL_CHOICES["moe"]), default="auto",
                   help="kernel for the INT4 routed experts. mosaic_gpu: the Mosaic GPU grouped MoE kernel "
                   "(Hopper, bf16 params; the experts' layout is converted once after loading); triton: the "
                   "Triton grouped kernel on the checkpoint layout (any GPU, also float32 models); xla: the "
                   "plain-JAX reference. auto (default): mosaic_gpu where it can run, on a GPU xla for a small "
                   "expert stack (measured faster there), else triton on a GPU, else xla. A kernel that cannot "
                   "run here is an error (docs/kernels.md)")
    g.add_argument("--attention-kernel", choices=("auto", *KERNEL_CHOICES["attention"]), default="auto",
                   help="kernel for the tree attention: mosaic_gpu (a Hopper GPU, bf16) or xla "
                   "(the plain-JAX reference); auto (default): on a GPU the one measured fastest at each call "
                   "shape (Mosaic GPU for K2-shaped bf16 attention: an AR step over >= 32768 cache rows, a "
                   "verify of >= 33 tokens over >= 4096), else xla")
    g.add_argument("--linear-kernel", choices=("auto", *KERNEL_CHOICES["linear"]), default="auto",
                   help="kernel for INT4 dense linears (shared experts and dense MLPs of a checkpoint quantized "
                   "with kj.quantize(policy='experts+shared' or 'all_mlp')): mosaic_gpu (a Hopper GPU, bf16; the "
                   "weights converted to its layout once at load; calls of more than 64 rows, a prefill, run XLA) or "
                   "xla "
                   "(dequantize, then XLA's dot); auto (default): mosaic_gpu where it runs and measured faster "
                   "(dims multiples of 64, bf16 scales, weights of 1 M elements or more), else xla")
    g.add_argument("--tree-kernel", choices=("auto", *KERNEL_CHOICES["tree"]), default="auto",
                   help="DDTree tree build: triton (one kernel launch per round, a GPU) or xla (the jnp builder, "
                   "about five XLA kernels per draft depth); both build the same tree. auto (default): triton on a "
                   "GPU, else xla")
    g.add_argument("--mla-weights", choices=("auto", *KERNEL_CHOICES["mla"]), default="auto",
                   help="the cached forward's projections: folded (W_UK pre-multiplied into q_b and W_UV into o "
                   "once per call: three matmuls a layer instead of five, a few MiB more weights; each MLP's entry "
                   "matrices one matmul; on a GPU [N, K] copies for one-row products) or separate (the "
                   "checkpoint's matrices). auto (default): folded when that adds at most 4 MiB a layer (a small "
                   "model, whose decode is launch-bound), separate otherwise (K2.6) and on a mesh")
    g.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest", metavar="PRECISION",
                   help="float32 matmul precision, one of %(choices)s (default: %(default)s: how the engine runs "
                   "float32, where greedy DDTree == AR is proved). 'default' is JAX's (TF32 on NVIDIA GPUs, whose "
                   "rounding differs between the AR step and the tree-shaped verify, so greedy DDTree can leave the "
                   "AR path at near-ties). The others are XLA dot algorithms of float32 accuracy from bf16 / TF32 "
                   "tensor-core passes: BF16_BF16_F32_X9 ran the shipped pair's greedy DDTree 13-27%% faster than "
                   "highest (H200 and H100, budgets 7-31) with output == AR on every prompt measured, and AR no "
                   "slower (kdtree_jax.precision); the CPU lacks X9 and TF32. bf16 models are unaffected")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint to an Orbax checkpoint",
                       description="Convert HF_DIR (safetensors; dense, FP8 block-128 or INT4 pack-quantized) "
                       "to a kdtree-jax Orbax checkpoint at OUT_DIR, one layer at a time (peak host memory "
                       "about one layer). OUT_DIR appears only once complete and verified; a failure or "
                       "Ctrl-C leaves nothing behind.")
    c.add_argument("hf_dir", metavar="HF_DIR", help="the Hugging Face checkpoint directory (with "
                   "--to-hf-drafter: the kdtree-jax drafter checkpoint)")
    c.add_argument("out_dir", metavar="OUT_DIR", help="where to write the checkpoint (must not exist)")
    drafter_dir = c.add_mutually_exclusive_group()
    drafter_dir.add_argument("--drafter", action="store_true", help="HF_DIR is a z-lab DFlash drafter "
                             "(config.json with dflash_config); write a kdtree-jax drafter checkpoint")
    drafter_dir.add_argument("--to-hf-drafter", action="store_true", help="the other way: HF_DIR is a "
                             "kdtree-jax drafter checkpoint; write it in DFlash's Hugging Face format "
                             "(config.json + model.safetensors, weights in their saved dtype)")
    c.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the dense weights "
                   "(router stays float32, INT4 experts stay INT4; default: %(default)s)")
    c.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is a kdtree-jax checkpoint "
                   "(only once the new one is complete); anything else at OUT_DIR, HF_DIR itself or a directory "
                   "holding it is never replaced")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("init", help="write a random-weight checkpoint (for tests and benchmarks)",
                       description="Write a random-weight target checkpoint of a preset, or with --drafter a "
                       "random drafter checkpoint for a target.")
    i.add_argument("out_dir", metavar="OUT_DIR", help="where to write the checkpoint (must not exist)")
    i.add_argument("--preset", choices=PRESETS, help="the target config (default: tiny unless --target)")
    i.add_argument("--layers", type=int, metavar="N", help="number of target decoder layers (default: the "
                   "preset's)")
    i.add_argument("--drafter", action="store_true", help="write a drafter for the target instead of the "
                   "target itself")
    i.add_argument("--target", metavar="DIR", help="with --drafter: the target checkpoint the drafter is for "
                   "(instead of --preset)")
    i.add_argument("--drafter-layers", type=int, default=1, metavar="N", help="drafter decoder layers "
                   "(default: %(default)s)")
    i.add_argument("--block-size", type=int, default=16, metavar="N", help=f"drafter block size, 2 to "
                   f"{MAX_BLOCK_SIZE}: drafts block_size - 1 tokens per round (default: %(default)s)")
    i.add_argument("--mask-token-id", type=int, metavar="ID", help="drafter mask token (default: the "
                   "target config's mask_token_id)")
    i.add_argument("--seed", type=_seed, default=0, help=f"PRNG seed of the weights, 0 to {MAX_SEED} "
                   "(default: %(default)s)")
    i.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype (default: %(default)s)")
    i.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is a kdtree-jax checkpoint "
                   "(only once the new one is complete; anything else is never replaced)")
    i.set_defaults(func=cmd_init)

    n = sub.add_parser("info", help="describe a checkpoint without loading its tensors",
                       description="Print a checkpoint's kind, config, parameter count, bytes by dtype and "
                       "its INT4 tensors (read from the tensor index; no tensor data is loaded).")
    n.add_argument("checkpoint", metavar="CHECKPOINT", help="a kdtree-jax checkpoint directory")
    n.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    n.set_defaults(func=cmd_info)

    v = sub.add_parser("verify", help="check every tensor of a checkpoint against its recorded checksum",
                       description="Read every tensor of CHECKPOINT (one layer at a time) and compare its bytes "
                       "with the sha256 recorded when it was written. Exit status 0 when all match; 2 naming the "
                       "first corrupt tensor, or when the checkpoint predates checksums.")
    v.add_argument("checkpoint", metavar="CHECKPOINT", help="a kdtree-jax checkpoint directory")
    v.set_defaults(func=cmd_verify)
    return parser


# ----------------------------------------------------------------------------------------- helpers
def _dtype(name: str):
    import jax.numpy as jnp  # noqa: PLC0415 (keeps --help fast)

    return jnp.dtype(name)


def _preset_config(name: str, layers: int | None):
    from kdtree_jax.config import ModelConfig  # noqa: PLC0415

    cfg = {"tiny": ModelConfig.tiny}[name]()
    if layers is not None:
        if layers < 1:
            raise CLIError(f"--layers must be >= 1, got {layers}")
        cfg = cfg.replace(num_hidden_layers=layers, first_k_dense_replace=min(cfg.first_k_dense_replace, layers))
    return cfg


def _random_target(cfg, seed: int, dtype):
    import jax  # noqa: PLC0415

    from kdtree_jax.model import init_params  # noqa: PLC0415

    return init_params(cfg, jax.random.key(seed), dtype)


def _random_drafter(cfg, seed: int, dtype, *, layers: int = 1, block_size: int = 16, mask_token_id=None):
    import jax  # noqa: PLC0415

    from kdtree_jax.config import ConfigError  # noqa: PLC0415
    from kdtree_jax.drafter import DrafterConfig, init_drafter_params  # noqa: PLC0415

    if cfg.mask_token_id is None and mask_token_id is None:
        raise CLIError("the target config has no mask_token_id: pass --mask-token-id for the drafter")
    try:
        dcfg = DrafterConfig.for_target(cfg, num_layers=layers, block_size=block_size, mask_token_id=mask_token_id)
    except ConfigError as e:
        raise CLIError(f"cannot build a drafter for this target: {e}") from None
    # a key of its own, so the drafter does not reuse the target's random streams
    return dcfg, init_drafter_params(dcfg, jax.random.fold_in(jax.random.key(seed), 1), dtype)


def _check_dir(path: str, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CLIError(f"{what} {path!r} does not exist")
    if not p.is_dir():
        raise CLIError(f"{what} {path!r} is not a directory")
    return p


def _load_tokenizer(path: str):
    if not Path(path).is_file():
        raise CLIError(f"tokenizer file {path!r} does not exist")
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 (optional dependency: the "train" extra)
    except ImportError:
        raise CLIError("--tokenizer needs the 'tokenizers' package, which is not installed "
                       "(pip install tokenizers, or pass token ids without --tokenizer)") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (the Rust binding raises a bare Exception for malformed files)
        raise CLIError(f"cannot read tokenizer {path!r}: {e}") from None


def _check_prompt_text(prompts: list[str] | None) -> None:
    """A prompt of bytes that are not UTF-8 reaches Python as lone surrogates (the shell passed raw bytes,
    e.g. from a Latin-1 file): refuse it by name instead of failing inside the tokenizer."""
    for text in prompts or ():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = ord(text[e.start])
            what = f"byte {bad - 0xDC00:#04x}" if 0xDC80 <= bad <= 0xDCFF else f"character {bad:#06x}"
            raise CLIError(f"--prompt {text!r} is not valid UTF-8: {what} at position {e.start} "
                           "(convert the text to UTF-8, e.g. iconv -t utf-8)") from None


def _parse_prompts(prompts: list[str] | None, tokenizer, cfg) -> list[list[int]]:
    if not prompts:
        if cfg.bos_token_id is None:
            raise CLIError("give a --prompt (the config has no bos_token_id to start from)")
        return [[cfg.bos_token_id]]
    out = []
    for text in prompts:
        if tokenizer is not None:
            ids = list(tokenizer.encode(text).ids)
            if not ids:
                raise CLIError(f"prompt {text!r} encodes to no tokens")
        else:
            words = text.replace(",", " ").split()
            if not words:
                raise CLIError("--prompt is empty: give space-separated token ids")
            bad = [w for w in words if not re.fullmatch(r"[+-]?\d+", w)]
            if bad:
                raise CLIError(f"--prompt must be space-separated token ids, got {bad[0]!r} in {text!r} "
                               "(pass --tokenizer tokenizer.json for text prompts)")
            ids = [int(w) for w in words]
        out.append(ids)
    return out


def _heal_prompts(prompts: list[list[int]], tokenizer, cfg):
    """Token healing of encoded text prompts (kdtree_jax.healing): (prompts without their last token,
    first-token mask bool [B, V] or None, removed text of each prompt). A tokenizer that is not byte-level
    gets a note and no healing."""
    import numpy as np  # noqa: PLC0415

    from kdtree_jax.healing import heal  # noqa: PLC0415

    healed, masks, removed = [], [], []
    for ids in prompts:
        try:
            short, mask, text = heal(tokenizer, ids, vocab_size=cfg.vocab_size)
        except ValueError as e:
            STATUS.close()
            print(f"{PROG}: note: prompts are not healed: {e} (--no-heal turns healing off)", file=sys.stderr)
            return prompts, None, [""] * len(prompts)
        healed.append(short)
        masks.append(mask)
        removed.append(text)
    return healed, np.stack(masks), removed


def _load_model(args):
    """(cfg, params, description) from exactly one of --checkpoint / --hf / --preset."""
    sources = [name for name in ("checkpoint", "hf", "preset", "shipped") if getattr(args, name)]
    if len(sources) != 1:
        raise CLIError("give exactly one model source: --checkpoint DIR, --hf DIR, --preset NAME or --shipped"
                       + (f" (got {', '.join('--' + s for s in sources)})" if sources else ""))
    if args.layers is not None and not args.preset:
        raise CLIError("--layers applies to --preset only")
    if args.shipped:
        args.checkpoint = str(ASSETS / "target")
        # stored in bfloat16; float32 is where greedy DDTree == AR holds exactly (bf16 can part at a near-tie)
        args.dtype = args.dtype or "float32"
    if args.checkpoint:
        from kdtree_jax.checkpoint import load_checkpoint  # noqa: PLC0415

        cfg, params = load_checkpoint(_check_dir(args.checkpoint, "checkpoint directory"), expect_kind="target",
                                      mesh=args.mesh, verify=not args.no_verify,  # straight into its shardings
                                      dtype=_dtype(args.dtype) if args.dtype else None)
        stored = params["embed_tokens"].dtype.name
        return cfg, params, f"checkpoint {args.checkpoint} ({f'cast to {args.dtype}' if args.dtype else stored})"
    if args.hf:
        from kdtree_jax.hf import load_hf  # noqa: PLC0415

        dtype = args.dtype or "bfloat16"
        STATUS.close()  # its progress bar takes the line
        cfg, params = load_hf(_check_dir(args.hf, "Hugging Face directory"), _dtype(dtype), progress=True)
        return cfg, params, f"Hugging Face {args.hf} ({dtype})"
    cfg = _preset_config(args.preset, args.layers)
    dtype = args.dtype or "float32"
    desc = f"preset {args.preset} (random, seed {args.seed}, {dtype})"
    return cfg, _random_target(cfg, args.seed, _dtype(dtype)), desc


def _kernels(args):
    from kdtree_jax.kernels import Kernels  # noqa: PLC0415

    return Kernels(attention=args.attention_kernel, linear=args.linear_kernel, moe=args.moe_kernel,
                   tree=args.tree_kernel, mla=args.mla_weights)


_FLAGS = {"attention": "--attention-kernel", "linear": "--linear-kernel", "moe": "--moe-kernel",
          "tree": "--tree-kernel", "mla": "--mla-weights"}


def kernel_plan_line(params, cfg, kernels=None, sharded: bool = False) -> str:
    """The one line saying which kernel every op runs here (sharded: over --mesh), with hints a CLI user can
    act on: where a flag pinned an op to something other than what auto would run, and where the model's dtype
    keeps the routed experts off the Mosaic GPU kernel."""
    from kdtree_jax.kernels import Kernels, kernel_plan, plan_summary  # noqa: PLC0415

    kernels = kernels or Kernels()
    plan = kernel_plan(params, cfg, kernels=kernels, sharded=sharded)
    hints = []
    pinned = [op for op in _FLAGS if getattr(kernels, op) != "auto"]
    if pinned:
        auto = kernel_plan(params, cfg, kernels=Kernels(interpret=kernels.interpret), sharded=sharded)
        hints += [f"{_FLAGS[op]} auto would run {auto[op][0]}" for op in pinned if auto[op][0] != plan[op][0]]
    if plan["moe"][0] == "triton" and "bf16 activations" in plan["moe"][1]:
        hints.append("a bfloat16 model runs the routed experts on the Mosaic GPU kernel (--dtype bfloat16, or "
                     "'convert --dtype bfloat16')")
    return f"kernels: {plan_summary(plan)}" + (f"; hint: {'; '.join(hints)}" if hints else "")


def _load_drafter(args, cfg, methods, params=None):
    if not any(m in ("dflash", "ddtree") for m in methods):
        if args.drafter or args.hf_drafter:
            flag = "--drafter" if args.drafter else "--hf-drafter"
            raise CLIError(f"{flag} is not used by --method {args.method}")
        return None, None
    if args.hf_drafter:
        from kdtree_jax.config import ConfigError  # noqa: PLC0415
        from kdtree_jax.hf_drafter import load_hf_drafter  # noqa: PLC0415

        if args.drafter:
            raise CLIError("give --drafter or --hf-drafter, not both")
        # the drafter runs in the target's activation dtype (its embedding's)
        dtype = params["embed_tokens"].dtype if params is not None else "bfloat16"
        try:
            dcfg, dparams = load_hf_drafter(_check_dir(args.hf_drafter, "DFlash drafter directory"),
                                            dtype, target=cfg)
        except ConfigError as e:
            raise CLIError(f"drafter {args.hf_drafter} does not fit the target: {e}") from None
        return (dcfg, dparams), f"DFlash drafter {args.hf_drafter} ({dtype})"
    if args.shipped and not args.drafter:
        args.drafter = str(ASSETS / "drafter")
    if args.drafter:
        from kdtree_jax.checkpoint import load_checkpoint  # noqa: PLC0415
        from kdtree_jax.config import ConfigError  # noqa: PLC0415

        dcfg, dparams = load_checkpoint(_check_dir(args.drafter, "drafter directory"), expect_kind="drafter",
                                        verify=not args.no_verify,  # --dtype casts the pair alike
                                        dtype=_dtype(args.dtype) if args.dtype and args.checkpoint else None)
        try:
            dcfg.check_target(cfg)
        except ConfigError as e:
            raise CLIError(f"drafter {args.drafter} does not fit the target: {e}") from None
        return (dcfg, dparams), f"drafter {args.drafter}"
    if args.preset:
        dtype = args.dtype or "float32"
        return _random_drafter(cfg, args.seed, _dtype(dtype)), "random drafter (untrained: low acceptance)"
    raise CLIError(f"--method {args.method} needs a drafter: --drafter DIR (write a random one with "
                   f"'{PROG} init DIR --drafter --target CHECKPOINT')")


def _mean_acceptance(out) -> float:
    acc = out.round_acceptances()
    return float(acc.mean()) if acc.size else 0.0


def _budget(text: str):
    """--budget: 'auto' or an integer (its range is checked in cmd_generate, with the other flags)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _run(cfg, params, prompts, method, drafter, args, first_token_mask=None):
    """(output, seconds of the timed call). Compiles first with an untimed call unless --no-warmup."""
    import jax  # noqa: PLC0415

    from kdtree_jax.generate import generate  # noqa: PLC0415

    kwargs: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, method=method, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, key=jax.random.key(args.seed), stop_tokens=args.stop,
                  mesh=args.mesh, kernels=_kernels(args), first_token_mask=first_token_mask)
    if method != "ar":
        kwargs["drafter"] = drafter
    if method == "ddtree":
        kwargs["tree_budget"] = args.budget
    if not args.no_warmup:  # compile first, so tokens/s measures the compiled program
        with STATUS.step(f"compiling {method} (a first, untimed call)"):
            jax.block_until_ready(generate(cfg, params, prompts, **kwargs))
    what = f"generating {method}" + (" (compilation included: --no-warmup)" if args.no_warmup else "")
    with STATUS.step(what) as timing:
        out = jax.block_until_ready(generate(cfg, params, prompts, **kwargs))
    return out, timing["seconds"]


def _budget_note(budget, out) -> str:
    """'32', or for auto which budgets the rounds verified: 'auto (AR x6, 8 x3, 32 x5 rounds)' (AR: rounds that drafted
    nothing)."""
    if budget != "auto":
        return str(budget)
    return "auto (" + ", ".join(f"{b or 'AR'} x{n}" for b, n in rounds_per_budget(out).items()) + " rounds)"


# ---------------------------------------------------------------------------------------- commands
def cmd_generate(args) -> None:
    if args.budget is not None and args.method not in ("ddtree", "all"):
        raise CLIError(f"--budget applies to --method ddtree / all, not {args.method}")
    args.budget = DEFAULT_BUDGET if args.budget is None else args.budget
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.budget != "auto" and not 1 <= args.budget <= MAX_TREE_BUDGET:  # before loading: kj.generate says it too
        raise CLIError(f"--budget must be in [1, {MAX_TREE_BUDGET}], got {args.budget}")
    _check_prompt_text(args.prompt)
    if args.no_heal and not (args.tokenizer or args.shipped):
        raise CLIError("--no-heal applies to text prompts: --tokenizer FILE or --shipped")
    if args.shipped and not args.tokenizer:
        args.tokenizer = str(ASSETS / "tokenizer.json")
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    methods = ["ar", "dflash", "ddtree"] if args.method == "all" else [args.method]
    import jax  # noqa: PLC0415

    try:
        set_matmul_precision(args.matmul_precision, platform=jax.default_backend())
    except ValueError as e:
        raise CLIError(f"--matmul-precision: {e}") from None
    if args.mesh is not None:  # a Mesh before any weight is read, so a bad spec fails fast
        from kdtree_jax.sharding import make_mesh  # noqa: PLC0415

        args.mesh = make_mesh(args.mesh)
    from kdtree_jax.kernels import prepare_params  # noqa: PLC0415

    with STATUS.step("loading the target"):
        cfg, params, model_desc = _load_model(args)
        kernels = _kernels(args)
        # before converting: a kernel that cannot run fails here
        plan_line = kernel_plan_line(params, cfg, kernels, sharded=args.mesh is not None)
        params = prepare_params(params, cfg, kernels)  # INT4 weights to the Mosaic layout where it runs (once)
    prompts = _parse_prompts(args.prompt, tokenizer, cfg)
    encoded, first_token_mask, removed = prompts, None, [""] * len(prompts)
    if tokenizer is not None and args.prompt and not args.no_heal:
        prompts, first_token_mask, removed = _heal_prompts(prompts, tokenizer, cfg)
    needs_drafter = any(m in ("dflash", "ddtree") for m in methods)
    with STATUS.step("loading the drafter") if needs_drafter else contextlib.nullcontext():
        drafter, drafter_desc = _load_drafter(args, cfg, methods, params)
        if drafter is not None and args.drafter_dtype:
            drafter = DFlashDraft(*drafter, compute_dtype=args.drafter_dtype)
            drafter_desc = f"{drafter_desc}, computing in {args.drafter_dtype}"
    print(f"model: {model_desc}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}" + (f"; {drafter_desc}" if drafter_desc else ""))
    print(plan_line)
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, seed {args.seed}"
    results = []
    for method in methods:
        out, seconds = _run(cfg, params, prompts, method, drafter, args, first_token_mask)
        results.append((method, out, seconds))
    reference_rows = results[0][1].rows()
    for method, out, seconds in results:
        rows = out.rows()
        new = sum(len(r) for r in rows)
        print(f"\n[{method}] {sampling}" + (f", budget {_budget_note(args.budget, out)}" if method == "ddtree" else ""))
        for b, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
            print(f"prompt {b}: {' '.join(map(str, prompt))}")
            if tokenizer is not None:
                print(f"  prompt text: {tokenizer.decode(encoded[b])!r}")
                if removed[b]:
                    print(f"  healed: token {encoded[b][-1]} {removed[b]!r} removed from the prompt; the first "
                          "new token starts with it")
            print(f"  tokens: {' '.join(map(str, row))}")
            if tokenizer is not None:
                print(f"  text: {tokenizer.decode(prompt + row)!r}")
        undrafted = rounds_per_budget(out).get(0, 0) if method == "ddtree" else 0
        step = ("one decode step each" if method == "ar" else "draft + verify each" if not undrafted else
                f"draft + verify, or an AR step where drafting could not pay: {undrafted} of them")
        print(f"  {new} new tokens in {int(out.rounds)} rounds ({step}); {int(out.num_target_forwards)} "
              "target forwards (the rounds + the prompt's prefill)")
        timed = "compilation included: --no-warmup" if args.no_warmup else "compilation excluded"
        print(f"  mean acceptance length {_mean_acceptance(out):.2f} (tokens committed per round); "
              f"{new / seconds:.1f} tokens/s ({timed})")
    if len(results) > 1:
        print(f"\n{'method':<8} {'tokens/s':>10} {'target fwd':>11} {'mean accept':>12}  same tokens as ar")
        for method, out, seconds in results:
            rows = out.rows()
            same = "yes" if rows == reference_rows else "no"
            if args.temperature > 0 and method != "ar":
                same += " (sampling: only the distribution must match)"
            print(f"{method:<8} {sum(len(r) for r in rows) / seconds:>10.1f} {int(out.num_target_forwards):>11} "
                  f"{_mean_acceptance(out):>12.2f}  {same}")
        import jax  # noqa: PLC0415

        if jax.default_backend() == "cpu" and any(m != "ar" for m, _, _ in results):
            print("note: on a CPU a verify of T tokens costs about T decode steps (the cores are busy with one "
                  "token already), so speculative decoding cannot beat AR here; on a GPU it costs about one step")


def cmd_convert(args) -> None:
    from kdtree_jax.checkpoint import check_destination  # noqa: PLC0415
    from kdtree_jax.convert import convert_hf  # noqa: PLC0415

    if args.drafter or args.to_hf_drafter:
        return _convert_drafter(args)
    _check_dir(args.hf_dir, "Hugging Face directory")
    check_destination(args.out_dir, overwrite=args.overwrite, inputs={"Hugging Face directory": args.hf_dir})
    start = time.perf_counter()
    path = convert_hf(args.hf_dir, args.out_dir, _dtype(args.dtype), overwrite=args.overwrite,
                      progress=not args.no_progress)
    print(f"wrote {path} ({_dir_bytes(path) / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s); "
          f"verified against the config's tensor list")


def _convert_drafter(args) -> None:
    """convert --drafter (DFlash HF -> Orbax) and --to-hf-drafter (Orbax -> DFlash HF)."""
    from kdtree_jax.checkpoint import check_destination, load_checkpoint, save_checkpoint  # noqa: PLC0415
    from kdtree_jax.hf_drafter import export_hf_drafter, load_hf_drafter  # noqa: PLC0415

    check_destination(args.out_dir, overwrite=args.overwrite, inputs={"input directory": args.hf_dir})
    if args.to_hf_drafter:
        dcfg, dparams = load_checkpoint(_check_dir(args.hf_dir, "drafter checkpoint"), expect_kind="drafter")
        path = export_hf_drafter(dcfg, dparams, args.out_dir, overwrite=args.overwrite)
        print(f"wrote DFlash drafter {path} ({dcfg.num_hidden_layers} layers, block {dcfg.block_size})")
        return
    dcfg, dparams = load_hf_drafter(_check_dir(args.hf_dir, "DFlash drafter directory"), _dtype(args.dtype))
    path = save_checkpoint(args.out_dir, dcfg, dparams, overwrite=args.overwrite)
    print(f"wrote drafter checkpoint {path} ({dcfg.num_hidden_layers} layers, block {dcfg.block_size}, reads "
          f"target layers {list(dcfg.target_layer_ids)}, mask token {dcfg.mask_token_id})")


def cmd_init(args) -> None:
    from kdtree_jax.checkpoint import check_destination, load_checkpoint, save_checkpoint  # noqa: PLC0415

    # before building any weights; a drafter never replaces the target it is made for
    check_destination(args.out_dir, overwrite=args.overwrite,
                      inputs={"target checkpoint": args.target} if args.drafter and args.target else {})
    dtype = _dtype(args.dtype)
    if not args.drafter:
        for flag in ("target", "mask_token_id"):
            if getattr(args, flag) is not None:
                raise CLIError(f"--{flag.replace('_', '-')} applies to 'init --drafter' only")
        cfg = _preset_config(args.preset or "tiny", args.layers)
        path = save_checkpoint(args.out_dir, cfg, _random_target(cfg, args.seed, dtype), overwrite=args.overwrite)
        print(f"wrote random {args.preset or 'tiny'} target ({cfg.num_hidden_layers} layers, {args.dtype}) to {path}")
        return
    if args.target and (args.preset or args.layers is not None):
        raise CLIError("give either --target CHECKPOINT or --preset/--layers for the drafter's target, not both")
    if args.target:
        cfg, _ = load_checkpoint(_check_dir(args.target, "target checkpoint"), expect_kind="target")
    else:
        cfg = _preset_config(args.preset or "tiny", args.layers)
    for name in ("drafter_layers", "block_size"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    dcfg, dparams = _random_drafter(cfg, args.seed, dtype, layers=args.drafter_layers, block_size=args.block_size,
                                    mask_token_id=args.mask_token_id)
    path = save_checkpoint(args.out_dir, dcfg, dparams, overwrite=args.overwrite)
    print(f"wrote random drafter ({dcfg.num_hidden_layers} layers, block {dcfg.block_size}, reads target layers "
          f"{list(dcfg.target_layer_ids)}, {args.dtype}) to {path}")


def checkpoint_info(path: str | Path) -> dict[str, Any]:
    """What `info` prints, as a dict: kind, config, param_dtype, parameter count, bytes by dtype, INT4
    tensors. Read from config.json and the Orbax tensor index only."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from kdtree_jax.checkpoint import checkpoint_index  # noqa: PLC0415

    # absolute: Orbax reads a relative path's tensor index as None ("'NoneType' object has no attribute 'tree'")
    path = _check_dir(str(path), "checkpoint directory").absolute()
    if not (path / "config.json").exists() and any(path.glob("*.safetensors")):
        raise CLIError(f"{path} is a Hugging Face checkpoint, not a kdtree-jax one: convert it first "
                       f"('{PROG} convert {path} OUT_DIR')")
    cfg, meta, index = checkpoint_index(path)
    leaves = jax.tree_util.tree_flatten_with_path(index)[0]
    by_dtype: Counter = Counter()
    count = 0
    int4: dict[str, dict] = {}
    for key_path, leaf in leaves:
        name = "/".join(str(getattr(k, "key", k)) for k in key_path)
        dtype = np.dtype(leaf.dtype)
        size = int(np.prod(leaf.shape, dtype=np.int64))
        by_dtype[dtype.name] += size * dtype.itemsize
        if name.endswith("/qweight") and dtype == np.int16:  # INT4 leaf: 4 weights per int16 word
            count += 4 * size
            *lead, n, k4 = leaf.shape
            int4.setdefault(name[: -len("/qweight")], {})["shape [.., N, K]"] = [*lead, n, 4 * k4]
        elif name.endswith("/scale") and name[: -len("/scale")] in int4:
            int4[name[: -len("/scale")]]["scale_dtype"] = dtype.name
        else:
            count += size
    return {"path": str(path), "kind": meta["kind"], "format": meta["format"], "param_dtype": meta["param_dtype"],
            "config": meta["config"], "quantization": meta.get("quantization"), "parameters": count,
            "bytes_by_dtype": dict(sorted(by_dtype.items())), "total_bytes": sum(by_dtype.values()),
            "int4_tensors": int4, **_info_kernels(meta["kind"], cfg, index)}


def _info_kernels(kind: str, cfg, index) -> dict[str, Any]:
    """For a target: the kernel plan on this machine's first device (from shapes and dtypes only)."""
    if kind != "target":
        return {}
    import jax  # noqa: PLC0415

    from kdtree_jax.checkpoint import typed_from_stored  # noqa: PLC0415
    from kdtree_jax.kernels import kernel_plan  # noqa: PLC0415

    # the index is in the files' form: an INT4 weight is the dict {"qweight", "scale"}; the plan asks its type
    abstract = typed_from_stored(jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), index))
    plan = kernel_plan(abstract, cfg)
    return {"kernels": {op: {"kernel": kernel, "reason": reason} for op, (kernel, reason) in plan.items()},
            "kernels_line": kernel_plan_line(abstract, cfg)}


def cmd_info(args) -> None:
    info = checkpoint_info(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    print(f"{info['path']}: {info['kind']} checkpoint (format {info['format']}), param dtype {info['param_dtype']}")
    print("config:")
    for key, value in info["config"].items():
        print(f"  {key}: {json.dumps(value)}")
    print(f"parameters: {info['parameters']:,} (an INT4 weight counts as one)")
    print(f"bytes: {info['total_bytes']:,} ({info['total_bytes'] / 2**30:.3f} GiB)")
    for dtype, nbytes in info["bytes_by_dtype"].items():
        print(f"  {dtype}: {nbytes:,}")
    if info["int4_tensors"]:
        print(f"INT4 tensors ({len(info['int4_tensors'])}, group 32):")
        for name, desc in info["int4_tensors"].items():
            print(f"  {name}: {desc['shape [.., N, K]']} scales {desc.get('scale_dtype')}")
    else:
        print("INT4 tensors: none")
    if "kernels_line" in info:
        print(f"{info['kernels_line']} (on this machine)")


def cmd_verify(args) -> None:
    from kdtree_jax.checkpoint import verify_checkpoint  # noqa: PLC0415

    path = _check_dir(args.checkpoint, "checkpoint directory")
    start = time.perf_counter()
    result = verify_checkpoint(path)
    print(f"{path}: all {result['tensors']} tensors ({result['bytes'] / 2**20:.1f} MiB) match their sha256 checksums "
          f"({time.perf_counter() - start:.1f} s)")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -------------------------------------------------------------------------------------------- main
def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    STATUS.close()
    print(f"{PROG}: note: {message}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to sys.exit)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv  # accepted anywhere on the line, not only before COMMAND
    argv = [a for a in argv if a != "--traceback"]
    with warnings.catch_warnings():  # restores the filters and showwarning on the way out
        warnings.showwarning = _show_warning  # one line per warning, no source excerpt
        # JAX's notice that its Pallas Triton backend is deprecated is for kernel authors (docs/kernels.md),
        # not something a CLI user can act on
        warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                                category=DeprecationWarning)
        storage = sys.modules.get("kdtree_jax.storage")
        committed_before = len(storage.COMMITTED) if storage else 0
        try:
            args = parser.parse_args(argv)
            if args.command is None:
                raise CLIError("no command given: choose one of generate, convert, init, info, verify "
                               f"(see '{PROG} --help')")
            args.func(args)
            return 0
        except KeyboardInterrupt:
            STATUS.close()
            storage = sys.modules.get("kdtree_jax.storage")
            written = storage.COMMITTED[committed_before:] if storage else []
            # a Ctrl-C held back during a checkpoint's commit lands just after it: that result is whole
            kept = "".join(f"; {p} had been written in full before it and is kept" for p in written)
            print(f"{PROG}: interrupted{kept}", file=sys.stderr)
            _quiet_after_interrupt()
            return 130
        except Exception as e:  # noqa: BLE001 (the CLI's contract: one line, no traceback)
            if show_traceback:
                raise
            from kdtree_jax.checkpoint import CheckpointError  # noqa: PLC0415
            from kdtree_jax.config import ConfigError  # noqa: PLC0415
            from kdtree_jax.hf import HFCheckpointError  # noqa: PLC0415

            expected = (CLIError, CheckpointError, HFCheckpointError, ConfigError, ValueError, OSError)
            # an unexpected exception is a bug: name its type so the report can be found
            prefix = "" if isinstance(e, expected) else f"internal error ({type(e).__name__}; rerun with --traceback): "
            STATUS.close()
            print(f"{PROG}: error: {prefix}{_one_line(e)}", file=sys.stderr)
            return 2


def run() -> None:
    """The `kdtree-jax` program: main(), then exit with its status. Once main() has returned, the work is
    done (or cleanly refused): a Ctrl-C that lands while Python shuts down (joining Orbax's threads, say)
    must not turn a finished run into a death by signal, so SIGINT is ignored from there on."""
    import signal  # noqa: PLC0415

    status = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if status == 130:  # the leftovers of interrupted work, collected at shutdown, stay quiet too
        _quiet_after_interrupt()
    sys.exit(status)


def _quiet_after_interrupt() -> None:
    """What interrupted work leaves behind is not something to act on, so "interrupted" stays the last line:
    an async checkpoint write's never-awaited coroutine (a warning when it is garbage collected), Orbax's
    background commit thread, which logs an absl ERROR when it finds the temporary directory the abort
    removed, and an asyncio event loop the interrupt caught half-closed, whose __del__ then raises ("Exception
    ignored in: BaseEventLoop.__del__ ... Invalid file descriptor: -1", seen in CI on 2026-12-07)."""
    import logging  # noqa: PLC0415

    warnings.simplefilter("ignore")
    logging.getLogger("absl").setLevel(logging.CRITICAL + 1)
    sys.unraisablehook = lambda _unraisable: None


if __name__ == "__main__":
    run()
