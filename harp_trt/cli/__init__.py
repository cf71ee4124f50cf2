"""``harp-trt`` command line. One module per command under ``harp_trt/cli/``, registered in
``COMMANDS`` (a lazy registry: an unknown command gets a "did you mean"); each defines ``NAME``,
``HELP``, ``add_arguments(parser)`` and ``run(args) -> dict``. A flag that sets a stage config's field
is generated from the field (``harp_trt.cli._options``). The dict is the command's
figures: rendered for a person (by the module's own ``render(result, console)`` where it has one, build's
summary; else as tables), or as one JSON object on stdout's last line with ``--json``.

A ``HarpError`` is printed in one or two lines and the process exits with its code (2 for bad
input); nothing else is caught, so real bugs keep their traceback."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..errors import HarpError, UnknownNameError
from ..lazy import Registry

__all__ = ["main", "COMMANDS"]

# command name -> its module harp_trt.cli.<name>, imported when the parser is built (a command's module
# imports no framework at module level, so `harp-trt --help` does not import torch); listed in this order
COMMANDS: Registry = Registry("command")
COMMANDS.register_modules(__name__, ("build", "score", "calibrate", "sweep", "eval", "rewrite", "cache", "bench", "deploy",
                                     "generate"))


def common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="artifact cache folder (default ~/.cache/harp-trt or $HARP_TRT_CACHE)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the figures as the last stdout line")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harp-trt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS.in_order():
        mod = COMMANDS.get(name)
        p = sub.add_parser(name, help=mod.HELP.replace("%", "%%"), description=mod.HELP)
        mod.add_arguments(p)
        common_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def emit(result: dict[str, Any], as_json: bool, module: Any = None) -> None:
    """``result`` as one JSON line, or for a person: the command module's own ``render(result,
    console)`` where it has one (build's summary), else the generic tables (``render.render``)."""
    from .render import make_console, render

    if as_json:
        clean = {k: v for k, v in result.items() if not k.startswith("_")}
        sys.stdout.write(json.dumps(clean, default=str) + "\n")
    elif callable(getattr(module, "render", None)):
        module.render(result, make_console())
    else:
        render(result)


def _quiet_libraries() -> None:
    """Hide Hugging Face progress bars and warnings: errors must stay one or two lines."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


# (logger, start of a message) that is noise to a harp-trt user and dropped at its logger: torch's ONNX
# exporter warns once per torchvision op it cannot register when torchvision is not installed, and
# harp-trt's models use none of them ("torchvision is not installed. Skipping torchvision::nms", x4)
NOISE = (("torch.onnx._internal.exporter._registration", "torchvision is not installed"),)


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _drop_noise() -> None:
    """Attach a filter for each ``NOISE`` entry to its logger (once): those records only, the
    logger's other warnings pass."""
    for name, prefix in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessages(prefix))


def _terminate_as_interrupt() -> None:
    """SIGTERM (what CI runners, ``timeout`` and container stops send) unwinds like Ctrl-C, so the
    store's temp folder is removed on the way out instead of being left half-written."""
    import signal
    import threading

    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def main(argv: list[str] | None = None) -> int:
    from ..memory import tune_allocator

    tune_allocator()  # freed layers go back to the system (harp_trt/memory.py)
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-"):
        try:
            COMMANDS.check(argv[0])  # "did you mean", before argparse's bare "invalid choice"
        except UnknownNameError as e:
            print(f"harp-trt: error: {e}", file=sys.stderr)
            return e.exit_code
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:
        _quiet_libraries()
    _drop_noise()
    _terminate_as_interrupt()
    try:
        result = args._module.run(args)
    except HarpError as e:
        print(f"harp-trt {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"harp-trt {args.command}: interrupted; no artifact was written", file=sys.stderr)
        return 130
    emit(result, args.json, args._module)
    return int(result.get("exit_code", 0)) if isinstance(result, dict) else 0


if __name__ == "__main__":
    sys.exit(main())
