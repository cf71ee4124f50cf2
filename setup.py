"""The packages the install holds: every folder with an ``__init__.py`` under harp_trt/ and under the
folders mapped into it (bench/, builders/, calib/ install as harp_trt.bench, harp_trt.builders,
harp_trt.calib: site-packages gets no top-level package but harp_trt), found here so that a new
runtime's or stage's folder installs without a hand-written list. The rest is pyproject.toml's."""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# the same mapping as harp_trt.PACKAGE_DIRS (a checkout's finder; tests/test_house.py checks both)
PACKAGE_DIRS = {"harp_trt.bench": "bench", "harp_trt.builders": "builders", "harp_trt.calib": "calib"}


def packages() -> list[str]:
    """Import names of the package folders, e.g. builders/ort -> harp_trt.builders.ort."""
    out = []
    for name, folder in {"harp_trt": "harp_trt", **PACKAGE_DIRS}.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            out.append(".".join((name, *init.parent.relative_to(ROOT / folder).parts)))
    return out


if __name__ == "__main__":   # setuptools' build backend runs this file as __main__
    setup(package_dir=PACKAGE_DIRS, packages=packages())
