"""An lm-evaluation-harness model over a bench ``Engine`` (PyTorch reference or ONNX Runtime).

``EngineLM`` subclasses lm-eval's ``TemplateLM`` (an ``lm_eval.api.model.LM``): lm-eval does the
context/continuation split and the empty-context handling, this class scores token sequences with
the engine's teacher-forced logits and generates greedily with its prefill/decode steps. Requests
are scored in batches of similar length, right-padded: with causal attention a position never
sees the padding after it, so no attention mask is needed and every backend gets the same input.
Sequences longer than the model's context keep their last ``max_length`` tokens, like lm-eval's
Hugging Face model."""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F

from harp_trt.extras import require

require("lm_eval", "the bench's accuracy tasks need it")  # a typed error naming the extra, not an ImportError
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from .engines import Engine  # noqa: E402

__all__ = ["EngineLM"]

log = logging.getLogger(__name__)


class EngineLM(TemplateLM):
    def __init__(self, engine: Engine, tokenizer: Any, batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = 64):
        super().__init__()
        self.engine = engine
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(min(max_length or engine.max_positions, engine.max_positions))
        self.max_gen_toks = max_gen_toks
        self.calls = 0          # engine forward passes made (for tests and the report)

    # ---- tokenizer -----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        tid = self.tokenizer.eos_token_id
        return int(tid if tid is not None else 0)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.eot_token_id)

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "tokenizer").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """None (lm-eval's default): as the model starts a prompt, BOS first where its tokenizer adds
        one (``harp_trt.data.encode_prompt``; SmolLM2's adds none, so its special ``<|im_start|>`` is not
        put in); True / False: the tokenizer's own special tokens, or none."""
        from harp_trt.data import encode_prompt

        if add_special_tokens is None:
            return encode_prompt(self.tokenizer, string)
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- scoring -------------------------------------------------------------------------------
    def _score(self, seqs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Each (context ids, continuation ids) -> (sum log p(continuation), greedy?)."""
        results: list[tuple[float, bool] | None] = [None] * len(seqs)
        inputs = []
        for i, (ctx, cont) in enumerate(seqs):
            whole = (ctx + cont)[-(self.max_length + 1):]
            inp = whole[:-1]  # position j predicts whole[j + 1]
            inputs.append((i, inp, min(len(cont), len(inp))))
        order = sorted(inputs, key=lambda x: -len(x[1]))
        for b in range(0, len(order), self.batch_size):
            chunk = order[b: b + self.batch_size]
            width = max(len(x[1]) for x in chunk)
            pad = self.eot_token_id
            batch = torch.tensor([x[1] + [pad] * (width - len(x[1])) for x in chunk], dtype=torch.long)
            logp = F.log_softmax(self.engine.logits(batch), dim=-1)
            self.calls += 1
            for row, (i, inp, n_cont) in enumerate(chunk):
                ctx, cont = seqs[i]
                n = len(inp)
                lp = logp[row, n - n_cont: n]
                target = torch.tensor(cont[-n_cont:], dtype=torch.long)
                score = float(lp.gather(-1, target[:, None]).sum())
                greedy = bool((lp.argmax(-1) == target).all())
                results[i] = (score, greedy)
        return results  # type: ignore[return-value]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = self._score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            # the prefix token (BOS) starts the document: the text itself gets no second one
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, self.max_length, 1)]
            total = sum(s for s, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # ---- generation ----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self.eot_token_id])
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                log.warning("generate_until: sampling requested; the bench decodes greedily")
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            logits, state = self.engine.prefill(torch.tensor([ids], dtype=torch.long))
            self.calls += 1
            gen: list[int] = []
            text = ""
            for step in range(max_new):
                tok = int(logits.argmax(-1))
                if tok == self.eot_token_id:
                    break
                gen.append(tok)
                text = self.tok_decode(gen)
                if any(u in text for u in until if u) or step == max_new - 1:
                    break
                logits, state = self.engine.decode(torch.tensor([[tok]], dtype=torch.long), state)
                self.calls += 1
            for u in until:
                if u and u in text:
                    text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def evaluate_tasks(lms: dict[str, "EngineLM"], tasks: list[str], include_path: list[str],
                   limit: int | None, seed: int = 0) -> list[dict[str, Any]]:
    """Run lm-eval's ``simple_evaluate`` on each model in ``lms`` ({variant: EngineLM}) over the
    tasks found in ``include_path`` (built-in tasks are not indexed: nothing reaches a hub).
    Returns one row per (variant, task, metric) with value and standard error."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from .tasks import offline_env

    offline_env()
    tm = TaskManager(include_path=include_path, include_defaults=False)
    rows = []
    for variant, lm in lms.items():
        # lm-eval prints progress ("bootstrapping for stddev") to stdout, which belongs to --json
        with contextlib.redirect_stdout(sys.stderr):
            res = simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit, log_samples=False,
                                  bootstrap_iters=100, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed)
        for task, metrics in res["results"].items():
            n = (res.get("n-samples") or {}).get(task, {}).get("effective")
            for key, value in metrics.items():
                if key == "alias" or "_stderr" in key or not isinstance(value, (int, float)):
                    continue
                metric, _, filt = key.partition(",")
                stderr = metrics.get(f"{metric}_stderr,{filt}")
                rows.append({"variant": variant, "task": task, "metric": metric, "filter": filt or "none",
                             "value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                             "n": n})
    return rows
