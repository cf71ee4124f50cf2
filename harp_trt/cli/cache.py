"""harp-trt cache ls | rm KEY"""
from __future__ import annotations

import argparse

from ..store import ArtifactStore

NAME = "cache"
HELP = "list (ls) or remove (rm KEY) cached artifacts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["ls", "rm"])
    p.add_argument("key", nargs="?", help="artifact key for rm (e.g. calibrate-0123abcd4567ef89)")


def run(args) -> dict:
    from ..errors import ConfigError

    if args.action == "rm" and not args.key:
        raise ConfigError("cache rm needs a KEY", "see `harp-trt cache ls`")
    if args.action == "ls" and args.key:
        raise ConfigError(f"cache ls takes no KEY (got {args.key!r})", "harp-trt cache ls lists every artifact")
    store = ArtifactStore(args.workdir)
    if args.action == "rm":
        store.remove(args.key)
        return {"removed": args.key, "root": str(store.root)}
    rows = [{"key": a.key, "stage": a.manifest.get("stage"), "created": a.manifest.get("created"),
             "model": (a.manifest.get("model") or {}).get("ref", ""),
             "seconds": a.manifest.get("seconds")} for a in store.list()]
    return {"root": str(store.root), "artifacts": [r["key"] for r in rows], "_tables": {"artifacts": rows}}
