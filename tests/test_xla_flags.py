"""kdtree_jax.xla_flags: the flags importing the engine adds to XLA_FLAGS, and when it must not."""

from __future__ import annotations

import os
import subprocess
import sys

from kdtree_jax import xla_flags


def test_apply_adds_the_recommended_flags_once():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    added = xla_flags.apply(env, backends_started=False)
    assert added == list(xla_flags.RECOMMENDED)
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", *xla_flags.RECOMMENDED]
    assert xla_flags.apply(env, backends_started=False) == []  # already there: nothing twice
    assert env["XLA_FLAGS"].split().count(xla_flags.RECOMMENDED[0]) == 1
    empty: dict[str, str] = {}
    assert xla_flags.apply(empty, backends_started=False) == list(xla_flags.RECOMMENDED)
    assert empty["XLA_FLAGS"] == " ".join(xla_flags.RECOMMENDED)


def test_apply_leaves_the_users_flags_alone():
    name = xla_flags.RECOMMENDED[0].split("=")[0]
    mine = {"XLA_FLAGS": f"{name}=7"}
    assert xla_flags.apply(mine, backends_started=False) == []
    assert mine["XLA_FLAGS"] == f"{name}=7"  # the user's value wins
    opted_out = {xla_flags.OPT_OUT: "0"}
    assert xla_flags.apply(opted_out, backends_started=False) == [] and "XLA_FLAGS" not in opted_out
    late: dict[str, str] = {}
    assert xla_flags.apply(late, backends_started=True) == [] and "XLA_FLAGS" not in late  # XLA would not read it


def _flags_after(code: str, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_flags.OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", code + "\nimport os; print(os.environ.get('XLA_FLAGS', ''))"],
                         env={**clean, **env}, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def test_importing_the_engine_sets_them_only_before_a_backend_starts():
    assert _flags_after("import kdtree_jax").split() == list(xla_flags.RECOMMENDED)
    assert _flags_after("import jax; jax.devices(); import kdtree_jax") == ""  # too late: left unset
    assert _flags_after("import kdtree_jax", **{xla_flags.OPT_OUT: "0"}) == ""
