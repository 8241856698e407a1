"""Convert a Hugging Face DeepSeek-V3 / Kimi K2.x checkpoint to a kdtree-jax Orbax checkpoint.

`convert_hf(hf_dir, out_dir, dtype)` reads the HF shards one top-level params entry at a time
(embed_tokens, layers_0, ..., final_norm, lm_head; `hf.open_hf`) and writes each as its own Orbax
item (`checkpoint.CheckpointWriter`), so host memory peaks at about one layer, never the whole model.
The output appears at `out_dir` only once every entry is written and the tensor index on disk matches
the config's abstract tree; a failure or Ctrl-C leaves nothing behind (no partial checkpoint, no
temporary directory). INT4 (compressed-tensors) routed experts stay INT4: the checkpoint's
`quantization` records them as {"int4_leaves": {path: scale dtype}}.

`load_checkpoint(out_dir)` then gives the same params as `load_hf(hf_dir, dtype)`, bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from kdtree_jax.checkpoint import CheckpointWriter
from kdtree_jax.hf import open_hf


def hf_quantization(int4_leaves: dict[str, str]) -> dict | None:
    """The checkpoint `quantization` metadata of an HF import with these INT4 leaves (None if dense)."""
    if not int4_leaves:
        return None
    # group size 32, symmetric: the only INT4 scheme hf.open_hf accepts and the params leaf holds
    return {"int4_leaves": dict(int4_leaves)}


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype=jnp.bfloat16, *,
               overwrite: bool = False, progress: bool = True) -> Path:
    """Convert `hf_dir` to an Orbax checkpoint at `out_dir`, entry by entry; returns out_dir.

    dtype: floating dtype of the dense weights (router in float32; INT4 experts untouched).
    Raises HFCheckpointError for a bad HF directory (before anything is written) and CheckpointError
    when out_dir exists (unless overwrite; with it, when out_dir is anything but a kdtree-jax checkpoint),
    is or contains hf_dir, is being written by another process, or the written checkpoint does not verify.
    """
    hf = open_hf(Path(hf_dir), dtype)  # every header check runs here, before a byte is written
    # overwrite replaces only a kdtree-jax checkpoint, and never the HF input or a directory holding it
    writer = CheckpointWriter(out_dir, hf.cfg, param_dtype=hf.dtype, quantization=hf_quantization(hf.int4_leaves),
                              overwrite=overwrite, inputs={"Hugging Face directory": hf_dir})
    with writer, tqdm(total=len(hf.entries), desc=f"converting {hf.path.name}", unit="entry",
                      disable=not progress) as bar:
        for entry, subtree in hf:
            writer.write(entry, subtree)
            size = sum(leaf.nbytes for leaf in jax.tree.leaves(subtree))
            del subtree  # the only reference: this entry's memory goes before the next one is read
            bar.set_postfix_str(f"{entry} {size / 2**20:.1f} MiB", refresh=False)
            bar.update(1)
    return writer.path
