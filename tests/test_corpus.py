"""The package corpus (training/corpus.py, training/data.py's `source`): the wheel extraction rule, the
SHA-256 check of downloads and cached files, the held-out rule on package-prefixed paths and the pinned
list's form. No network: the wheels are small zips built here and "downloaded" from file: URLs."""

from __future__ import annotations

import hashlib
import re
import zipfile
import zlib
from pathlib import Path

import pytest

from training import corpus
from training.corpus import PACKAGES, PERMISSIVE_LICENSES, Package, fetch_wheel, validate_packages, wheel_sources
from training.data import corpus_files, is_held_out

KEPT = {  # member name in the wheel -> text; every one passes the extraction rule
    "fakepkg/__init__.py": "from fakepkg.core import add\n",
    "fakepkg/core.py": "def add(a, b):\n    return a + b\n",
    "fakepkg/testing.py": "def helper():\n    pass\n",  # 'test' in a file name, not a folder: kept
    "fakepkg/tests.py": "X = 1\n",
    "fakepkg/sub/util.py": "Y = 'é'\n",  # UTF-8 beyond ASCII is fine
    "toplevel.py": "import fakepkg\n",  # outside the package folder: gets the prefix
    **{f"fakepkg/gen/mod{i:02d}.py": f"VALUE = {i}\n" for i in range(40)},
}
DROPPED = {  # member name -> bytes; every one is excluded
    "fakepkg/tests/test_core.py": b"def test_add():\n    assert True\n",
    "fakepkg/sub/test/helper.py": b"Z = 2\n",
    "fakepkg/Tests/test_case.py": b"W = 1\n",
    "fakepkg/_vendor/six.py": b"PY3 = True\n",
    "fakepkg/vendor/lib.py": b"V = 1\n",
    "fakepkg/_vendored/dateutil.py": b"V = 2\n",
    "fakepkg/third_party/scipy.py": b"V = 3\n",
    "fakepkg/latin1.py": "NAME = 'café'\n".encode("latin-1"),  # not UTF-8
    "fakepkg/empty.py": b"  \n\n",
    "fakepkg/table.py": b"T = [" + b"0, " * 400_000 + b"]\n",  # over 1 MB
    "fakepkg/data.txt": b"not python\n",
    "fakepkg-1.0.dist-info/METADATA": b"Name: fakepkg\n",
}
FAKE_WHEEL = "fakepkg-1.0-py3-none-any.whl"


def make_wheel(path: Path, members: dict[str, bytes]) -> Package:
    """Write a zip at `path` and return a Package pinned to it (MIT, a dummy BLAKE2b digest)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return Package("fakepkg", "1.0", path.name, "MIT", sha, "0" * 64)


@pytest.fixture
def fake(tmp_path) -> tuple[Path, Package]:
    """(wheel path, its Package): KEPT and DROPPED members, in tmp_path/src."""
    members = {name: text.encode("utf-8") for name, text in KEPT.items()} | DROPPED
    path = tmp_path / "src" / FAKE_WHEEL
    return path, make_wheel(path, members)


def expected_path(member: str) -> str:
    return member if member.startswith("fakepkg/") else f"fakepkg/{member}"


def test_wheel_sources_keeps_exactly_the_rules_files_with_prefixed_paths(fake):
    path, pkg = fake
    got = dict(wheel_sources(path, pkg.prefix))
    assert got == {expected_path(name): text for name, text in KEPT.items()}
    assert "fakepkg/toplevel.py" in got and "fakepkg/fakepkg/core.py" not in got  # prefix added once
    assert list(got) == sorted(got)  # member-name order


def test_prefix_normalises_the_name():
    pkg = Package("More.Itertools-x", "1", "w", "MIT", "0" * 64, "0" * 64)
    assert pkg.prefix == "more_itertools_x"


def test_wheel_sources_rejects_a_non_zip_and_clashing_members(tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a wheel"):
        list(wheel_sources(bad, "fakepkg"))
    clash = make_wheel(tmp_path / "clash" / FAKE_WHEEL, {"x.py": b"A = 1\n", "fakepkg/x.py": b"B = 2\n"})
    with pytest.raises(ValueError, match="fakepkg/x.py"):
        list(wheel_sources(tmp_path / "clash" / FAKE_WHEEL, clash.prefix))


def test_fetch_wheel_downloads_verifies_and_then_uses_the_cache(fake, tmp_path):
    path, pkg = fake
    cache = tmp_path / "cache"
    got = fetch_wheel(pkg, cache, url=path.as_uri())
    assert got == cache / FAKE_WHEEL and got.read_bytes() == path.read_bytes()
    assert sorted(p.name for p in cache.iterdir()) == [FAKE_WHEEL]  # no temporary file left
    # a verified cached file is used as is: the (missing) URL is never opened
    assert fetch_wheel(pkg, cache, url=(tmp_path / "missing.whl").as_uri()) == got


def test_a_corrupted_download_is_refused_and_leaves_no_file(fake, tmp_path):
    path, pkg = fake
    truncated = tmp_path / "truncated.whl"
    truncated.write_bytes(path.read_bytes()[:-100])
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="SHA-256"):
        fetch_wheel(pkg, cache, url=truncated.as_uri())
    assert list(cache.iterdir()) == []


def test_a_failed_transfer_leaves_no_file(fake, tmp_path):
    _, pkg = fake
    cache = tmp_path / "cache"
    with pytest.raises(OSError):
        fetch_wheel(pkg, cache, url=(tmp_path / "missing.whl").as_uri())
    assert list(cache.iterdir()) == []


def test_a_corrupted_cached_file_is_removed_and_downloaded_again(fake, tmp_path, capsys):
    path, pkg = fake
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / FAKE_WHEEL).write_bytes(path.read_bytes()[:-1] + b"X")
    assert fetch_wheel(pkg, cache, url=path.as_uri()).read_bytes() == path.read_bytes()
    assert "does not match" in capsys.readouterr().err
    # corrupted cache and a corrupted source: the bad cached file is gone and nothing takes its place
    (cache / FAKE_WHEEL).write_bytes(b"garbage")
    garbage = tmp_path / "garbage.whl"
    garbage.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="SHA-256"):
        fetch_wheel(pkg, cache, url=garbage.as_uri())
    assert list(cache.iterdir()) == []


def test_held_out_rule_on_package_prefixed_paths(fake, tmp_path, capsys):
    path, pkg = fake
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / FAKE_WHEEL).write_bytes(path.read_bytes())  # cached and verified: no download
    train = corpus_files("train", source="packages", cache=cache, packages=(pkg,))
    heldout = corpus_files("heldout", source="packages", cache=cache, packages=(pkg,))
    expected = {expected_path(name) for name in KEPT}
    assert {p for p, _ in train} | {p for p, _ in heldout} == expected
    assert {p for p, _ in train}.isdisjoint(p for p, _ in heldout)
    assert all(zlib.crc32(p.encode()) % 10 == 0 for p, _ in heldout)
    assert all(zlib.crc32(p.encode()) % 10 != 0 for p, _ in train)
    assert [p for p, _ in train] == sorted(p for p, _ in train)
    # the rule sees the prefixed path, not the member name
    assert ("fakepkg/toplevel.py" in dict(heldout)) == is_held_out("fakepkg/toplevel.py")
    assert f"{pkg.name} {pkg.version}: {len(expected)} files" in capsys.readouterr().err  # progress line


def test_all_is_the_stdlib_then_the_packages_and_stdlib_stays_the_default(fake, tmp_path):
    path, pkg = fake
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / FAKE_WHEEL).write_bytes(path.read_bytes())
    stdlib = corpus_files("heldout")
    assert stdlib == corpus_files("heldout", source="stdlib")
    assert not any(p.startswith("fakepkg/") for p, _ in stdlib)
    packages = corpus_files("heldout", source="packages", cache=cache, packages=(pkg,))
    assert corpus_files("heldout", source="all", cache=cache, packages=(pkg,)) == stdlib + packages


def test_bad_split_or_source_is_a_value_error():
    with pytest.raises(ValueError, match="source"):
        corpus_files("train", source="pypi")
    with pytest.raises(ValueError, match="split"):
        corpus_files("valid", source="packages")


def test_the_pinned_list_is_well_formed():
    validate_packages(PACKAGES)
    assert 20 <= len(PACKAGES) <= 40
    names = [p.prefix for p in PACKAGES]
    assert len(set(names)) == len(names)
    for p in PACKAGES:
        assert re.fullmatch(r"[0-9a-f]{64}", p.sha256) and re.fullmatch(r"[0-9a-f]{64}", p.blake2b_256)
        assert set(corpus.license_ids(p.license)) <= PERMISSIVE_LICENSES
        assert p.wheel.endswith("py3-none-any.whl") and f"-{p.version}-" in p.wheel
        assert p.url.startswith("https://files.pythonhosted.org/packages/") and p.url.endswith("/" + p.wheel)


@pytest.mark.parametrize("change, problem", [
    (dict(license="GPL-3.0-or-later"), "permissive"),
    (dict(license="MIT OR LGPL-2.1-only"), "permissive"),
    (dict(sha256="abc"), "sha256"),
    (dict(blake2b_256="Z" * 64), "blake2b_256"),
    (dict(wheel="fakepkg-1.0.tar.gz"), "pure-Python wheel"),
    (dict(wheel="fakepkg-1.0-cp312-cp312-manylinux_2_17_x86_64.whl"), "pure-Python wheel"),
    (dict(wheel="fakepkg-2.0-py3-none-any.whl"), "pure-Python wheel"),
])
def test_validate_packages_names_the_problem(change, problem):
    good = Package("fakepkg", "1.0", FAKE_WHEEL, "MIT", "a" * 64, "b" * 64)
    validate_packages([good])
    with pytest.raises(ValueError, match=problem):
        validate_packages([Package(**{**good.__dict__, **change})])


def test_validate_packages_refuses_a_repeated_name():
    good = Package("fakepkg", "1.0", FAKE_WHEEL, "MIT", "a" * 64, "b" * 64)
    with pytest.raises(ValueError, match="twice"):
        validate_packages([good, good])


def test_license_ids_splits_spdx_expressions():
    assert corpus.license_ids("MIT OR Apache-2.0") == ["MIT", "Apache-2.0"]
    assert corpus.license_ids("(BSD-2-Clause AND PSF-2.0)") == ["BSD-2-Clause", "PSF-2.0"]


def test_subset_keeps_every_kth_piece_and_the_whole_heldout(tmp_path):
    """training.data.write_subset: pieces 0, k, 2k, ... of the training stream (the last one partial), the held-out
    stream as it was, corpus.json counts what the files hold (load_token_file checks it)."""
    import json
    import lzma

    import numpy as np

    from training.data import TOKEN_DTYPE, load_token_file, write_subset

    src = tmp_path / "full"
    src.mkdir()
    streams = {"train": np.arange(10_000) % 4096, "heldout": np.arange(777) % 4096}
    for split, stream in streams.items():
        with lzma.open(src / f"{split}.u16.xz", "wb") as f:
            f.write(stream.astype(TOKEN_DTYPE).tobytes())
    (src / "corpus.json").write_text(json.dumps({"tokenizer_sha256": "x", "splits": {
        s: {"files": 1, "tokens": int(v.size), "bytes": 1} for s, v in streams.items()}}))
    meta = write_subset(src, tmp_path / "sub", keep_every=3, chunk=1000)
    train = load_token_file(tmp_path / "sub", "train")
    want = np.concatenate([streams["train"][i:i + 1000] for i in range(0, 10_000, 3000)])
    np.testing.assert_array_equal(train, want)  # pieces 0, 3, 6, 9
    np.testing.assert_array_equal(load_token_file(tmp_path / "sub", "heldout"), streams["heldout"])
    assert meta["subset"]["keep_every"] == 3 and meta["splits"]["train"]["tokens"] == 4000
    with pytest.raises(ValueError, match="keep_every"):
        write_subset(src, tmp_path / "bad", keep_every=0)
