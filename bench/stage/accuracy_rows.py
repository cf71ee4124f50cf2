"""The bench's accuracy table: held-out perplexity and agreement (``accuracy.py``), the exact
engines' perplexity beside quantized ones, and lm-eval tasks, as rows of ``accuracy.parquet``."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from harp_trt.store import Artifact

from .config import BenchConfig

if TYPE_CHECKING:
    from .stage import BenchInputs

__all__ = ["accuracy_rows", "heldout", "reference_ppl", "lm_eval_rows"]


def accuracy_rows(pair, inp: BenchInputs, config: BenchConfig, out_dir: Path,
                  phase) -> tuple[list[dict], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(rows, perplexities, agreement, lm-eval task info): the held-out perplexity and top-1
    agreement, the fp32 reference perplexity where given, greedy match and lm-eval tasks."""
    rows: list[dict] = []
    ppl, agree = heldout(pair, inp, config, phase)
    rows += [
        {"task": "heldout", "metric": "perplexity", "split": "heldout", "dense": ppl["dense"],
         "harp": ppl["harp"], "dense_stderr": None, "harp_stderr": None, "n": ppl["tokens"],
         "higher_is_better": False},
        {"task": "heldout", "metric": "top1_agreement", "split": "heldout", "dense": 1.0,
         "harp": agree["top1_agreement"], "dense_stderr": None, "harp_stderr": None,
         "n": ppl["tokens"], "higher_is_better": True},
    ]
    for ref in reference_ppl(pair, inp, config, phase):
        rows.append(ref)
        ppl[f"{ref['metric']}_dense"], ppl[f"{ref['metric']}_harp"] = ref["dense"], ref["harp"]
    if "greedy_match" in agree:
        rows.append({"task": "heldout", "metric": "greedy_match", "split": "heldout", "dense": 1.0,
                     "harp": agree["greedy_match"], "dense_stderr": None, "harp_stderr": None,
                     "n": agree["greedy_prompts"], "higher_is_better": True})
    task_info: dict[str, Any] = {}
    if config.tasks:
        task_rows, task_info = lm_eval_rows(pair, inp, config, out_dir, phase)
        rows += task_rows
    return rows, ppl, agree, task_info


def heldout(pair, inp: BenchInputs, config: BenchConfig, phase) -> tuple[dict, dict]:
    from harp_trt.data import token_windows

    from .accuracy import greedy_match, heldout_accuracy

    if inp.corpus is None:
        from harp_trt.errors import CorpusError

        raise CorpusError("the bench needs a corpus for held-out perplexity", "pass --corpus wiki or a file")
    windows = token_windows(pair.tokenizer, inp.corpus, "heldout", config.ppl_seq_len, config.ppl_tokens)
    phase(f"held-out perplexity on {windows.numel()} tokens")
    acc = heldout_accuracy(pair, windows, phase)
    ppl = {"dense": acc["ppl_dense"], "harp": acc["ppl_harp"], "increase": acc["ppl_harp"] / acc["ppl_dense"] - 1,
           "tokens": acc["tokens"], "seq_len": config.ppl_seq_len, "corpus": inp.corpus.name}
    agree = {"top1_agreement": acc["top1_agreement"]}
    if config.greedy_prompts:
        prompt_len = min(32, config.ppl_seq_len)
        prompts = windows[: config.greedy_prompts, :prompt_len]
        agree.update(greedy_match(pair, prompts, config.greedy_tokens))
    return ppl, agree


def reference_ppl(pair, inp: BenchInputs, config: BenchConfig, phase) -> list[dict]:
    """Held-out perplexity of the unquantized engines (source keys ``dense_fp32`` / ``harp_fp32``,
    given next to quantized ``dense`` / ``harp`` engines) on the same windows: one row, metric
    ``perplexity_fp32``, so a report shows what quantization costs beside what HARP costs."""
    names = ("dense_fp32", "harp_fp32")
    if not isinstance(inp.source, Mapping) or not all(k in inp.source for k in names):
        return []
    from .engine_ort import OrtEngine

    if not isinstance(pair.dense, OrtEngine):  # the fp32 engines are ORT engines beside ORT engines
        return []
    refs = {k: inp.source[k] for k in names}
    from harp_trt.data import token_windows
    from harp_trt.ort_session import OrtCausalLM
    from harp_trt.ppl import perplexity_from_logits_fn

    windows = token_windows(pair.tokenizer, inp.corpus, "heldout", config.ppl_seq_len, config.ppl_tokens)
    count = int((windows[:, 1:] >= 0).sum())  # tokens predicted (ppl.window_nll)
    out = {}
    for name, src in refs.items():
        lm = OrtEngine(OrtCausalLM.from_engine(src.path if isinstance(src, Artifact) else Path(src),
                                               intra_op_threads=config.threads or None), name, 1 << 30)
        out[name] = perplexity_from_logits_fn(lambda i, ids: lm.logits(ids), windows)
    phase(f"held-out perplexity of the fp32 engines: dense {out['dense_fp32']:.3f}, harp {out['harp_fp32']:.3f}")
    return [{"task": "heldout", "metric": "perplexity_fp32", "split": "heldout", "dense": out["dense_fp32"],
             "harp": out["harp_fp32"], "dense_stderr": None, "harp_stderr": None, "n": count,
             "higher_is_better": False}]


def lm_eval_rows(pair, inp: BenchInputs, config: BenchConfig, out_dir: Path, phase) -> tuple[list[dict], dict]:
    from .lm_eval_adapter import EngineLM, evaluate_tasks
    from .tasks import EVAL_TASKS, eval_data_root, write_task_yamls

    builtin = [t for t in config.tasks if t in EVAL_TASKS]
    include = [config.task_dir] if config.task_dir else []
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="harp-bench-tasks-") as td:
        if builtin:
            root = eval_data_root(inp.cache_root or Path(tempfile.gettempdir()), config.eval_data or None)
            info = write_task_yamls(builtin, root, Path(td))
            include.append(td)
        phase(f"lm-eval {', '.join(config.tasks)} (limit {config.limit or 'none'})")
        lms = {v: EngineLM(e, pair.tokenizer, batch_size=config.batch_size) for v, e in pair.engines().items()}
        rows = evaluate_tasks(lms, list(config.tasks), include, config.limit or None, seed=config.seed)
    table: dict[tuple, dict] = {}
    for r in rows:
        if r["metric"] in ("sample_len",):
            continue
        k = (r["task"], r["metric"])
        e = table.setdefault(k, {"task": r["task"], "metric": r["metric"],
                                 "split": info.get(r["task"], {}).get("split", "user"), "n": r["n"],
                                 "higher_is_better": r["metric"] != "perplexity"})
        e[r["variant"]] = r["value"]
        e[f"{r['variant']}_stderr"] = r["stderr"]
    out = [e for e in table.values() if "dense" in e and "harp" in e]
    for e in out:
        e.setdefault("dense_stderr", None)
        e.setdefault("harp_stderr", None)
    return out, info
