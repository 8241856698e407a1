"""The package part of the training corpus: the `.py` sources of a pinned list of permissively licensed,
pure-Python PyPI packages, taken from their wheels.

Each package is pinned to one `py3-none-any` wheel (exact version, file name, SHA-256 of the wheel), so
anyone rebuilds the same data. Wheels are downloaded from files.pythonhosted.org, which stores every file
under a path made of its BLAKE2b-256 digest (`packages/ab/cd/<rest>/<file>`); the digest is pinned too,
so no index query is needed. A wheel is written to the cache folder only after its SHA-256 matched.

Extraction rule, per wheel (`wheel_sources`): every `.py` member except those under a `test/` or
`tests/` folder (anywhere in the path, any case), under a vendored folder (`_vendor/`, `vendor/`,
`_vendored/`, `third_party/`: other projects' code), over 1 MB (generated tables), not UTF-8, or empty.
Paths are prefixed with the package name (lower case, runs of `-_.` as `_`) unless they already start with it:
`sympy/core/add.py`, `attrs/attr/_make.py`, `ipython/IPython/core/magic.py`.

    python -m training.corpus                      # download and verify every wheel (progress on stderr)
    python -m training.corpus --stats --tokenizer kdtree_jax/assets/tokenizer.json

The held-out rule (training/data.py) applies to the prefixed paths. Licences: docs/training.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

FILES_HOST = "https://files.pythonhosted.org/packages"
MAX_FILE_BYTES = 1_000_000
TEST_DIRS = frozenset({"test", "tests"})
VENDOR_DIRS = frozenset({"_vendor", "vendor", "_vendored", "third_party"})
# SPDX identifiers accepted in the pinned list; an expression's every identifier must be one of them.
PERMISSIVE_LICENSES = frozenset({"MIT", "BSD-2-Clause", "BSD-3-Clause", "Apache-2.0", "PSF-2.0", "ISC",
                                 "Unlicense", "0BSD", "LicenseRef-Public-Domain"})
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Package:
    """One pinned wheel: PyPI name, exact version, wheel file name, SPDX licence expression (as the
    wheel's metadata or licence file states it), SHA-256 and BLAKE2b-256 of the wheel (hex)."""

    name: str
    version: str
    wheel: str
    license: str
    sha256: str
    blake2b_256: str

    @property
    def prefix(self) -> str:
        """The package's path prefix in the corpus: lower case, runs of '-', '_', '.' as '_'."""
        return re.sub(r"[-_.]+", "_", self.name).lower()

    @property
    def url(self) -> str:
        b = self.blake2b_256
        return f"{FILES_HOST}/{b[:2]}/{b[2:4]}/{b[4:]}/{self.wheel}"


PACKAGES: tuple[Package, ...] = (
    Package("attrs", "26.1.0", "attrs-26.1.0-py3-none-any.whl", "MIT",
            "c647aa4a12dfbad9333ca4e71fe62ddc36f4e63b2d260a37a8b83d2f043ac309",
            "64b417d4b0b2a2dc85a6df63d1157e028ed19f90d4cd97c36717afef2bc2f395"),
    Package("babel", "2.19.0", "babel-2.19.0-py3-none-any.whl", "BSD-3-Clause",
            "6d49734aed1d595b2c065d012174df8c83964692f26fc461702281634dd7555b",
            "713bddf4b07be846bfa361683729b5948c9c61a87fbdf09e69540d8e586bb7c5"),
    Package("black", "26.10.1", "black-26.10.1-py3-none-any.whl", "MIT",
            "28842f9a8207cc1df6eb983a35a14c5a0dfcd603d214fe82d84bef552afd2e3a",
            "b1289dd29175c1db777e6189e2a0bb5f37101adf19c3e509b236c8920f778d0b"),
    Package("click", "8.5.1", "click-8.5.1-py3-none-any.whl", "BSD-3-Clause",
            "8bb5376d2006950386f8c6427613334a2acadc5f559cb80e638d00b4df957e37",
            "317d164b7ffc8624fe9efb4221bf9af485d5c1e41b9ae118045d2b6dc5457d8b"),
    Package("cython", "3.3.1", "cython-3.3.1-py3-none-any.whl", "Apache-2.0",
            "61abc7feedd20dac6c4ff7ab3a30e17136a067b242ab9253e2b4a6d9a72c2b61",
            "9d55088578d75bc8dbcbc535af04b1d596ff227ca756dd74f9d3c1c526f955d0"),
    Package("dagster", "1.13.29", "dagster-1.13.29-py3-none-any.whl", "Apache-2.0",
            "65f7bf2f52c0c1219cb1ca63a1f0f95a1af83d12e94ebec7598e47ee49889859",
            "ab136fa99cb8606a57fb504242bfa4053a55574d13d30056ebd5e0469efbb0d6"),
    Package("dask", "2026.8.0", "dask-2026.8.0-py3-none-any.whl", "BSD-3-Clause",
            "ccc0c83a189b0398602435189771d28dad7b5773b6089bb8dce14ae732dd782c",
            "f83a4fc99e788bcfa1b3b3f21abf57da45898d807d007e7f6fd1c7300904eb70"),
    Package("distributed", "2026.8.0", "distributed-2026.8.0-py3-none-any.whl", "BSD-3-Clause",
            "3bd8882861a2cf497453f28c6b61135fa8ef2bb1d6885ad3b9f27e887e9c0e01",
            "28d4017e2d39d797eaa38a52b4459c8bea875d5e0ada335a62aafe98193041a6"),
    Package("django", "6.1.3", "django-6.1.3-py3-none-any.whl", "BSD-3-Clause",
            "a0530e3fdac55d34ccc5893c36f6c57d7a7083064f3d414537e51473648b3290",
            "77f2adbe0352c6673f7b608724be5f69962c80ba1d06f8ed60fa4bfbec258b08"),
    Package("flask", "3.1.3", "flask-3.1.3-py3-none-any.whl", "BSD-3-Clause",
            "f4bcbefc124291925f1a26446da31a5178f9483862233b23c0c96a20701f670c",
            "7f9c34f6962f9b9e9c71f6e5ed806e0d0ff03c9d1b0b2340088a0cf4bce09b18"),
    Package("fonttools", "4.68.0", "fonttools-4.68.0-py3-none-any.whl", "MIT",
            "d76f8fdcb6936f5e1045a0c9dd721a4bf11112e60d1e243bfa1d39f06a8b3104",
            "35744ea331ecc65ba05a58b1e4e8ccd604c8a15565f876dfbf93fc2a2ea2e22b"),
    Package("ipython", "9.18.1", "ipython-9.18.1-py3-none-any.whl", "BSD-3-Clause",
            "997ce9140d374531a61069c70c0f9ef299d6dd3559ea0f94b8af589726e3c1d5",
            "bb1c91da4a1c541b75e97eb99d09c6a9b0534de55bb4a466669d1170e39b915c"),
    Package("jax", "0.12.0.1", "jax-0.12.0.1-py3-none-any.whl", "Apache-2.0",
            "e9dfd256ba090259b10f97f0755d4fc92535b8cb38c0a40df6488a8c8a7dd8ae",
            "f95dbe6a4b67161462d1a0a97c7405459c2f76a4c23c66b39ad496527f68a17d"),
    Package("jinja2", "3.1.6", "jinja2-3.1.6-py3-none-any.whl", "BSD-3-Clause",
            "85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67",
            "62a13d680cbfd5f4b8f15abc1d571870c5fc3e594bb582bc3b64ea099db13e56"),
    Package("keras", "3.15.1", "keras-3.15.1-py3-none-any.whl", "Apache-2.0",
            "836460e480930acbd19bb7a17e62f9ecad40e8a9af9a651fc8d0586a96d27e20",
            "8db3c9b848bbdba18e765a8051917c0cc82585b64278ce87895f2e521a27438f"),
    Package("mne", "1.13.2", "mne-1.13.2-py3-none-any.whl", "BSD-3-Clause",
            "36bbdd9fdc68431309a75e9dc6331b9de085cb6836688ac50b7b89f141a83cc3",
            "44e4face21e5da320fdc3a3e016ea93a28d1b786d01b36d75872627161a837aa"),
    Package("more-itertools", "11.2.1", "more_itertools-11.2.1-py3-none-any.whl", "MIT",
            "35a7377edd1dd6608dcb2cdf534ded55ea32d49448875ad042cd3f879fb1ded0",
            "5d573c4b1c6f2e0cc29ba023802458ea3d2a996f87085559e4a5f2192d549532"),
    Package("music21", "10.5.1", "music21-10.5.1-py3-none-any.whl", "BSD-3-Clause",
            "dc3309498c4c95cebdf8d4f20c868deb6b63bce1d929cad4f51a7ccc982987b1",
            "1512dee0eef7c82a63e83eea94bdcde97c66ab55213d89cee1347d2d11601faa"),
    Package("mypy", "2.4.1", "mypy-2.4.1-py3-none-any.whl", "MIT",
            "1784648d6ec8c2b5465e3f26241b845a0b3cb4e56c993c64abe16989e7698999",
            "215c6e8010f8f2c4ad817364592d4b3883633417269b913fc9d5174fdeb7e565"),
    Package("networkx", "3.7", "networkx-3.7-py3-none-any.whl", "BSD-3-Clause",
            "e3fd2c13a7814cee3746340d8d7f8598a67f16a58bf47fb7f8793fab6efca1b0",
            "7ecdfe58041e9011f307c490e3e17dd48cc516448f7c698a3f2d9d9d65d7e6a8"),
    Package("nltk", "3.10.4", "nltk-3.10.4-py3-none-any.whl", "Apache-2.0",
            "769ba5413f265b7d3e87cd163cc28efa01e29eeef8bb6080bc907949d9fcfb51",
            "a204e7816813e409ca874ba2fcc35455db0e4130b79eb277e1f9edd270ca3c69"),
    Package("pip", "26.3", "pip-26.3-py3-none-any.whl", "MIT",
            "f3b60b20ffaadd4415ed7957212a38ac63fa4c5fa375bd0f4a797777940fad13",
            "0725ee8c38ae72d66b844ce8eb9711ba905dba21ca1a8a0c960057c41cd23337"),
    Package("prefect", "3.9.1", "prefect-3.9.1-py3-none-any.whl", "Apache-2.0",
            "0c662e26e971b617993eed1f3d02fb8bc3c2dd47bee521b495f6e4dfeb38ae74",
            "8fda3c44e2775a24ed354787f98cbba3a53d7697ca94094f2413a331e1ca1aa2"),
    Package("pygments", "2.21.0", "pygments-2.21.0-py3-none-any.whl", "BSD-2-Clause",
            "2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9",
            "714617f022dd3e953bf20a04a028a21ec746d942f8d2af30fa0f124fa0e6a684"),
    Package("pyparsing", "3.3.3", "pyparsing-3.3.3-py3-none-any.whl", "MIT",
            "ece8c00a69cf01b45d0b1dedabb469c90d8caf996d4fda40f147627a122849a4",
            "38bbd215ee7c73b61497b28a5503f9f53523f294fcc936762b7caf90e0c1c2b5"),
    Package("pytest", "9.2.0", "pytest-9.2.0-py3-none-any.whl", "MIT",
            "07acdcf88ec174f907dc01af70bf52d49b014bbab03faeeade31c96b18c2e588",
            "51391f5d8c8877a0fa327db959c19341d4be61660de1ab6b7391f9eb805bcd67"),
    Package("requests", "2.34.2", "requests-2.34.2-py3-none-any.whl", "Apache-2.0",
            "2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0",
            "a0f4c67b0b3f1b9245e8d266f0f112c500d50e5b4e83cb6f3b71b6528104182a"),
    Package("rich", "15.0.0", "rich-15.0.0-py3-none-any.whl", "MIT",
            "33bd4ef74232fb73fe9279a257718407f169c09b78a87ad3d296f548e27de0bb",
            "823b64d4899d73f91ba49a8c18a8ff3f0ea8f1c1d75481760df8c68ef5235bf5"),
    Package("setuptools", "84.2.1", "setuptools-84.2.1-py3-none-any.whl", "MIT",
            "ca140b45d5325a9478f880e351484f62fef15f336462e449ca0c03c873d589c2",
            "ef556dc6d6bb953bdfc52519a0059592c52b6e3b8ad51cf8256dffceb55b0610"),
    Package("sphinx", "9.2.0", "sphinx-9.2.0-py3-none-any.whl", "BSD-2-Clause",
            "4c3ec13b612712c0d3ce4cbdd9e3eb91e68577e07a8e31f32f21cf178453578c",
            "c428a0c50761cd215b7042f4bc617a6bc5c0cd7be62f75bc908e169e28a4d21e"),
    Package("sqlalchemy", "2.1.9", "sqlalchemy-2.1.9-py3-none-any.whl", "MIT",
            "449fed5c2caa3b278cc57499d09db001fb3f28dc7f18affc48142aee4dcc0cdf",
            "7aee9926603a1f7e88b41bc0d1e068e889fc84981553fb4e6037426d6b174da3"),
    Package("sqlglot", "30.30.0", "sqlglot-30.30.0-py3-none-any.whl", "MIT",
            "06c4c212a7868c7dcff0fd0fda348dd3c5cbad40137b3083a70ecdfe22921cf9",
            "bc1f2472bab660417265daa9cf6baf7870583bfbd447608b525b0071cc4c5448"),
    Package("sqlparse", "0.6.1", "sqlparse-0.6.1-py3-none-any.whl", "BSD-3-Clause",
            "3be5a72d04c873d690d7c6dedd33d6fae2ef82759881ceec02fc2efd0cba564f",
            "dfff2fee788e82e75be8f210c65c5d103bf44c880e3769c884652a4cd911b8ba"),
    Package("sympy", "1.14.0", "sympy-1.14.0-py3-none-any.whl", "BSD-3-Clause",
            "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5",
            "a20977d55d46fd61b4a135c444fc97158ef34a095e5681d0a6c10b75bf356191"),
    Package("textual", "8.2.8", "textual-8.2.8-py3-none-any.whl", "MIT",
            "267375fd402dc8d981457212efa71f0e3365fd17bba144ba9bb3ed7563cb374a",
            "fbbe35261223d9416a0751cdff1c7b4a6f881387218a12d439fe22fefebc8c04"),
    Package("toolz", "1.2.0", "toolz-1.2.0-py3-none-any.whl", "BSD-3-Clause",
            "890f820b1cb8152785aaf9386d8707770110809035800985ca65cb24ce1120ef",
            "db174c8beb6c8c4176c6bf143bfd7e1e4dd6719b00ced90738c7ac471b71c1df"),
    Package("trio", "0.35.0", "trio-0.35.0-py3-none-any.whl", "MIT OR Apache-2.0",
            "9a062a029487c1bdbcc1b2543b729a0bde857ce478b1512c84f391f628e0c5c9",
            "0ac677f116686de6b1bb4159ef70d476ef75576ad7819d4eeb783f6efb40f380"),
    Package("twisted", "26.10.0", "twisted-26.10.0-py3-none-any.whl", "MIT",
            "3732f42af218925a0fe78d6668db55853f7fb532245a89a2669babe7d3000fa8",
            "1093fdfa79229fdc19a6542086d46b5c5d424ee62a6408d25657e8690e0a745f"),
    Package("werkzeug", "3.1.9", "werkzeug-3.1.9-py3-none-any.whl", "BSD-3-Clause",
            "6392e50c78460ba618e5b21f08a71f59c99ce99cdc6cf6e3dd7e6ccca8754fab",
            "a138df03f564f43cec2684823f3cccae1a652ee7face1cbaa76fb223096e64d7"),
    Package("xarray", "2026.9.0", "xarray-2026.9.0-py3-none-any.whl", "Apache-2.0",
            "fe349fa871628b1a0a5217af3fe1283a2862d5485156e6eda354fffb81c3bb7c",
            "3f443159af4fb3c868970a412e294320ed6bb1a9fbdfa6431050eda8e0b34b6e"),
)


def license_ids(expression: str) -> list[str]:
    """The SPDX identifiers of a licence expression ("MIT OR Apache-2.0" -> ["MIT", "Apache-2.0"])."""
    return [t for t in re.split(r"\s+(?:OR|AND|WITH)\s+|[()]", expression) if t.strip()]


def validate_packages(packages: Iterable[Package]) -> None:
    """ValueError naming the first problem of a pinned list: a repeated name, a hash that is not 64 hex
    digits, a licence outside PERMISSIVE_LICENSES, or a wheel name that is not `<name>-<version>-` ...
    `-none-any.whl` with a py3 tag."""
    seen: set[str] = set()
    for p in packages:
        if p.prefix in seen:
            raise ValueError(f"package {p.name!r} is listed twice")
        seen.add(p.prefix)
        for field in ("sha256", "blake2b_256"):
            if not _HEX64.fullmatch(getattr(p, field)):
                raise ValueError(f"{p.name}: {field} must be 64 lower-case hex digits, got {getattr(p, field)!r}")
        bad = [i for i in license_ids(p.license) if i not in PERMISSIVE_LICENSES]
        if bad or not p.license.strip():
            raise ValueError(f"{p.name}: licence {p.license!r} is not in the permissive set "
                             f"{sorted(PERMISSIVE_LICENSES)}")
        dist, version, *rest = p.wheel.split("-")
        if (re.sub(r"[-_.]+", "_", dist).lower() != p.prefix or version != p.version or len(rest) != 3
                or "py3" not in rest[0].split(".") or not p.wheel.endswith("-none-any.whl")):
            raise ValueError(f"{p.name}: {p.wheel!r} is not a pure-Python wheel of version {p.version} "
                             "(expected <name>-<version>-py3-none-any.whl)")


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kdtree-jax" / "wheels"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(pkg: Package, cache: Path, url: str | None = None) -> Path:
    """The verified wheel of `pkg` in `cache`, downloaded from `url` (default: `pkg.url`) if missing.

    A cached file whose SHA-256 does not match is removed and downloaded again. A download is written to
    a temporary file in `cache` and renamed into place only after its SHA-256 matched; a mismatch (a
    truncated or altered file) or a failed transfer removes it and raises, so no partial file remains."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / pkg.wheel
    if target.is_file():
        if sha256_file(target) == pkg.sha256:
            return target
        print(f"{pkg.wheel}: cached file does not match its SHA-256; removed, downloading again",
              file=sys.stderr, flush=True)
        target.unlink()
    fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=f".{pkg.wheel}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url or pkg.url, timeout=120) as response:
            for block in iter(lambda: response.read(1 << 20), b""):
                h.update(block)
                out.write(block)
        if h.hexdigest() != pkg.sha256:
            raise ValueError(f"{pkg.wheel}: downloaded SHA-256 {h.hexdigest()} does not match the pinned "
                             f"{pkg.sha256} (truncated or altered download); nothing was kept")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def is_excluded(member: str) -> bool:
    """The extraction rule's path part: not a .py file, or under a test or vendored folder (any case:
    Cython keeps its tests in `Tests/`)."""
    folders = [f.lower() for f in member.split("/")[:-1]]
    return not member.endswith(".py") or bool((TEST_DIRS | VENDOR_DIRS).intersection(folders))


def wheel_sources(path: Path, prefix: str) -> Iterator[tuple[str, str]]:
    """(prefixed path, text) of every .py member of the wheel at `path` that the extraction rule keeps,
    in member-name order. ValueError if the file is not a zip archive or two members map to one path."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path} is not a wheel (zip archive): {e}") from e
    seen: set[str] = set()
    with archive:
        for info in sorted(archive.infolist(), key=lambda i: i.filename):
            if info.is_dir() or is_excluded(info.filename) or info.file_size > MAX_FILE_BYTES:
                continue
            try:
                text = archive.read(info).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if not text.strip():
                continue
            rel = info.filename if info.filename.startswith(prefix + "/") else f"{prefix}/{info.filename}"
            if rel in seen:
                raise ValueError(f"{path}: two members map to the corpus path {rel!r}")
            seen.add(rel)
            yield rel, text


def package_corpus(packages: Iterable[Package] = PACKAGES, cache: Path | None = None,
                   progress: bool = True) -> Iterator[tuple[str, str]]:
    """(prefixed path, text) of every kept .py file of every package, package by package, downloading
    and verifying wheels as needed; one line per package (name, files, MB) on stderr if `progress`."""
    packages = tuple(packages)
    validate_packages(packages)
    cache = default_cache() if cache is None else Path(cache)
    for pkg in packages:
        files = list(wheel_sources(fetch_wheel(pkg, cache), pkg.prefix))
        if progress:
            mb = sum(len(text.encode("utf-8")) for _, text in files) / 1e6
            print(f"{pkg.name} {pkg.version}: {len(files)} files, {mb:.2f} MB", file=sys.stderr, flush=True)
        yield from files


def print_stats(cache: Path, tokenizer_path: Path | None) -> None:
    """A markdown table on stdout: per source (stdlib, packages, all) and split, files, MB and (with a
    tokenizer) tokens as training.data.token_stream lays them out (<bos> file <eos>)."""
    from tokenizers import Tokenizer

    # training.data imports this module, so it is imported here rather than at the top
    from training.data import is_held_out, source_files, token_stream

    tokenizer = Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path else None
    rows = []
    for source in ("stdlib", "packages"):
        files = source_files(source, cache=cache)
        for split in ("train", "heldout"):
            part = [f for f in files if is_held_out(f[0]) == (split == "heldout")]
            tokens = token_stream(tokenizer, part).size if tokenizer else 0
            rows.append((source, split, len(part), sum(len(t.encode("utf-8")) for _, t in part), tokens))
    for split in ("train", "heldout"):
        both = [r for r in rows if r[1] == split]
        rows.append(("all", split, *(sum(r[i] for r in both) for i in (2, 3, 4))))
    print("| source | split | files | MB | tokens (M) |\n|---|---|---|---|---|")
    for source, split, n, size, tokens in rows:
        print(f"| {source} | {split} | {n} | {size / 1e6:.2f} | {f'{tokens / 1e6:.2f}' if tokenizer else '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=None,
                        help=f"folder of the downloaded wheels (default: {default_cache()})")
    parser.add_argument("--stats", action="store_true",
                        help="print files, MB (and tokens with --tokenizer) per source and split")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json to count tokens with (only with --stats)")
    args = parser.parse_args()
    if args.tokenizer and not args.stats:
        parser.error("--tokenizer needs --stats")
    if args.tokenizer and not args.tokenizer.is_file():
        parser.error(f"no tokenizer at {args.tokenizer}")
    cache = default_cache() if args.cache is None else args.cache
    if args.stats:
        print_stats(cache, args.tokenizer)
    else:
        files = sum(1 for _ in package_corpus(cache=cache))
        print(f"{len(PACKAGES)} wheels verified in {cache}; {files} .py files kept")


if __name__ == "__main__":
    main()
