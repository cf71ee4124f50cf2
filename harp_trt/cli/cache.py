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
    store = ArtifactStore(args.workdir)
    if args.action == "rm":
        if not args.key:
            from ..errors import ConfigError

            raise ConfigError("cache rm needs a KEY", "see `harp-trt cache ls`")
        store.remove(args.key)
        return {"removed": args.key, "root": str(store.root)}
    rows = [{"key": a.key, "stage": a.manifest.get("stage"), "created": a.manifest.get("created"),
             "model": (a.manifest.get("model") or {}).get("ref", ""),
             "seconds": a.manifest.get("seconds")} for a in store.list()]
    return {"root": str(store.root), "artifacts": [r["key"] for r in rows], "_tables": {"artifacts": rows}}
