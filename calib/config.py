"""``CalibrateConfig``: the calibrate stage's settings. Light on purpose (no torch): the CLI
builds its flags from these fields' ``option`` declarations (``harp_trt.cli._options``), and
``harp-trt --help`` must not import a framework."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harp_trt.config import StageConfig, option, parse_grid, parse_ints, parse_seq_len
from harp_trt.stage_spec import StageSpec
from harp_trt.data import PAPER_BOS
from harp_trt.errors import ConfigError

from .strategies import STRATEGIES

__all__ = ["CalibrateConfig", "DEFAULT_GRID", "METHODS", "REPLACEMENTS", "FIT_INPUTS", "RECOVER", "SEARCH_SPLITS", "PAPER_BOS"]

DEFAULT_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))  # Algorithm 1's grid
METHODS = ("exhaustive", "golden")  # alpha search: every grid value, or golden-section (harp_trt.calib.search)
REPLACEMENTS = ("harp", "rrr", "lmmse")  # what a pruned block becomes (calib.fit): HARP's alpha, or a fitted map
FIT_INPUTS = ("sequential", "dense")     # which activations a map is fitted on (calib.fit)
RECOVER = ("none", "maps")  # end-to-end recovery after the layer-wise choice (calib.recover)
SEARCH_SPLITS = ("halves", "all")  # which documents the search reads (see CalibrateConfig)
GIVEN = "given layers and alphas (no search)"  # help section of the flags that skip scoring or search


@dataclass(frozen=True)
class CalibrateConfig(StageConfig):
    """Calibration settings. ``layers`` = P; ``tokens`` is the budget of each split.

    ``prune_layers`` fixes the layers (no scoring); ``alphas`` (ascending layer order, as plans
    store them) fixes the alphas (no search). ``objective``: ``windows`` = fixed windows of
    ``seq_len`` tokens over the corpus; ``paper`` = lm-eval ``wikitext``-style rolling windows over
    whole BOS-prefixed documents, ``seq_len`` 0 = the model's maximum length. ``search``:
    ``exhaustive`` (Algorithm 1 over every grid value) or ``golden`` (``harp_trt.calib.search.golden_search``).

    ``search_split``: ``halves`` = search on the corpus's even documents, report held-out
    perplexity on its odd ones; ``all`` = the HARP paper's split, search on every document of
    ``corpus`` (HARP searched all 62 WikiText-2 test documents) and report held-out perplexity on
    ``heldout_corpus``, a different text that must be named. ``paper_bos`` (``--objective paper``):
    ``once`` or ``lm-eval-0.4.7`` (Gemma documents scored as ``[BOS, BOS, doc]``, as that version
    does; ``harp_trt.data.paper_add_special_tokens``)."""

    VERSION = 3
    layers: int = option(2, short="-P", cli_default=None, help="number of layers to prune (default: the "
                         "preset's value, else %(field_default)s)")
    strategy: str = option("top", help="layer scoring: top, bottom, gate-norm, gate-norm-folded, sink, bi, "
                           "attn-sim, cca, cca-attn (default %(default)s)")
    alpha_grid: tuple[float, ...] = option(DEFAULT_GRID, parse=parse_grid,
                                           help="candidate alphas (default %(default)s)")
    search: str = option("exhaustive", choices=METHODS, help=(
        "exhaustive: every grid value (the paper's Algorithm 1); golden: golden-section over the sorted grid "
        "assuming unimodal perplexity, falling back to the full grid when a probe contradicts it "
        "(default %(default)s)"))
    tokens: int = option(8192, help="calibration tokens per split (default %(default)s)")
    seq_len: int = option(512, parse=parse_seq_len, cli_default=None, help=(
        "window length, or 'max' (the model's maximum length) (default %(field_default)s; "
        "with --objective paper: max)"))
    corpus: str = option("wiki", help="'wiki', 'c4' or a .txt/.jsonl file (default %(default)s)")
    objective: str = option("windows", choices=("windows", "paper"), help=(
        "windows: fixed windows of --seq-len over the corpus (default); paper: the HARP paper's objective, "
        "lm-eval wikitext style: whole documents prefixed with BOS in rolling windows of the model's "
        "maximum length, bf16 unless --dtype"))
    search_split: str = option("halves", choices=SEARCH_SPLITS, help=(
        "halves: search on the corpus's even documents, held-out perplexity on its odd ones (default); "
        "all: the HARP paper's split, search on every document of --corpus and report held-out perplexity "
        "on --heldout-corpus"))
    heldout_corpus: str = option("", help="with --search-split all: the other text ('wiki' or a .txt/.jsonl "
                                          "file) for held-out perplexity")
    paper_bos: str = option("once", choices=PAPER_BOS, help=(
        "with --objective paper: once = one BOS before each document (default); lm-eval-0.4.7 = as that "
        "version scores Gemma: its tokenizer's BOS after the prefix BOS, the second one scored"))
    replacement: str = option("harp", choices=REPLACEMENTS, help=(
        "harp: alpha * V.O, the paper (default); rrr: a fitted rank-kv_dim map B.A at HARP's cost (reduced-rank "
        "regression); lmmse: a fitted full-rank hidden x hidden map with bias (Neural Block Linearization; ONNX "
        "engines only). Maps and alphas are fitted on half of the calibration text; a layer keeps its map only "
        "where it beats the searched alpha on the other half"))
    fit_inputs: str = option("sequential", choices=FIT_INPUTS, help=(
        "with a fitted --replacement: sequential = fit the layers bottom-up, each on the inputs of the model "
        "whose lower layers already carry their maps (default); dense = every layer from one dense pass"))
    recover: str = option("none", choices=RECOVER, help=(
        "maps: after the layer-wise choice, train the pruned layers' replacement parameters (V and O with alpha "
        "folded in, or lmmse's W and b) end to end to the dense model's next-token distribution (KL) on the fit "
        "text, early-stopped on the select text; kept only where it beats the layer-wise plan there. Same shapes, "
        "so every engine carries it (default %(default)s)"))
    recover_tokens: int = option(32768, help="fit-text tokens recovery trains on (default %(default)s)")
    recover_steps: int = option(200, help="most Adam steps of recovery, one window each (default %(default)s)")
    recover_lr: float = option(1e-4, help="recovery's Adam learning rate (default %(default)s)")
    prune_layers: tuple[int, ...] = option((), parse=parse_ints, cli_default=None, group=GIVEN, help=(
        "prune exactly these layers, e.g. 28,29 (instead of a strategy's choice)"))
    alphas: tuple[float, ...] = option((), parse=parse_grid, cli_default=None, group=GIVEN, help=(
        "use these alphas instead of searching, one per pruned layer, e.g. 0.8,0.2"))
    score_tokens: int = option(0, help=("tokens the data-driven strategies score on (default 0: the first "
                                        "8 search windows; cca and cca-attn need >= 10 x the hidden size)"))
    score_windows: int = 8   # windows used by data-driven strategies when score_tokens is 0
    dtype: str = "float32"   # the CLI's default: bfloat16 on CUDA, float32 on the CPU
    device: str = "cpu"      # device kind (cpu | cuda): results differ between kinds

    def validate(self) -> None:
        STRATEGIES.check(self.strategy)  # "did you mean", without importing the strategy
        if self.score_tokens < 0:
            raise ConfigError(f"--score-tokens must be >= 0, got {self.score_tokens}")
        if self.layers <= 0:
            raise ConfigError(f"--layers must be a positive number of layers to prune, got {self.layers}")
        if not self.alpha_grid:
            raise ConfigError("--alpha-grid is empty; give values in [0, 1], e.g. 0,0.5,1")
        bad = [a for a in self.alpha_grid if not 0.0 <= float(a) <= 1.0]
        if bad:
            raise ConfigError(f"--alpha-grid values must lie in [0, 1]; got {bad}")
        if self.search not in METHODS:
            raise ConfigError(f"--search must be one of {', '.join(METHODS)}, got {self.search!r}")
        if self.objective not in ("windows", "paper"):
            raise ConfigError(f"--objective must be windows or paper, got {self.objective!r}")
        if self.objective == "windows":
            if self.seq_len < 2:
                raise ConfigError(f"--seq-len must be >= 2 with --objective windows, got {self.seq_len}")
            if self.tokens < self.seq_len:
                raise ConfigError(f"--tokens ({self.tokens}) must be at least one window (--seq-len {self.seq_len})")
        elif self.seq_len < 0:
            raise ConfigError(f"--seq-len must be >= 1 or max (0), got {self.seq_len}")
        self.check_split()
        if self.prune_layers:
            if len(self.prune_layers) != self.layers:
                raise ConfigError(f"--prune-layers gives {len(self.prune_layers)} layers but P is {self.layers}")
            if len(set(self.prune_layers)) != len(self.prune_layers) or min(self.prune_layers) < 0:
                raise ConfigError(f"--prune-layers must be distinct layer indices >= 0, got {list(self.prune_layers)}")
        if self.alphas:
            if len(self.alphas) != self.layers:
                raise ConfigError(f"--alphas gives {len(self.alphas)} values for {self.layers} pruned layers")
            bad = [a for a in self.alphas if not 0.0 <= float(a) <= 1.0]
            if bad:
                raise ConfigError(f"--alphas values must lie in [0, 1]; got {bad}")
        if self.replacement not in REPLACEMENTS:
            raise ConfigError(f"--replacement must be one of {', '.join(REPLACEMENTS)}, got {self.replacement!r}")
        if self.fit_inputs not in FIT_INPUTS:
            raise ConfigError(f"--fit-inputs must be one of {', '.join(FIT_INPUTS)}, got {self.fit_inputs!r}")
        if self.replacement != "harp" and self.alphas:
            raise ConfigError(f"--replacement {self.replacement} is chosen by the alpha search, which --alphas skips",
                              "drop --alphas, or use --replacement harp")
        self.check_recover()
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"CalibrateConfig.device is a device kind (cpu or cuda), got {self.device!r}")

    def check_recover(self) -> None:
        if self.recover not in RECOVER:
            raise ConfigError(f"--recover must be one of {', '.join(RECOVER)}, got {self.recover!r}")
        if self.recover == "none":
            return
        if self.objective != "windows":
            raise ConfigError("--recover trains on fixed windows of the fit text", "use --objective windows")
        if self.recover_steps < 1 or self.recover_tokens < self.seq_len:
            raise ConfigError(f"--recover-steps must be >= 1 and --recover-tokens at least one window of "
                              f"{self.seq_len}; got {self.recover_steps} and {self.recover_tokens}")
        if not 0.0 < self.recover_lr < 1.0:
            raise ConfigError(f"--recover-lr must lie in (0, 1), got {self.recover_lr}")

    @property
    def uses_select(self) -> bool:
        """A fitted map or recovery is chosen on the select text, so the fit text is split off."""
        return self.replacement != "harp" or self.recover != "none"

    def check_split(self) -> None:
        if self.search_split not in SEARCH_SPLITS:
            raise ConfigError(f"--search-split must be one of {', '.join(SEARCH_SPLITS)}, got {self.search_split!r}")
        if self.search_split == "all" and not self.heldout_corpus:
            raise ConfigError("--search-split all searches on every document of --corpus, so the held-out "
                              "perplexity needs another text", "name it: --heldout-corpus FILE (or wiki)")
        if self.search_split == "halves" and self.heldout_corpus:
            raise ConfigError("--heldout-corpus goes with --search-split all (with halves the held-out text is "
                              "the corpus's odd documents)", "add --search-split all, or drop --heldout-corpus")
        if self.heldout_corpus and self.heldout_corpus == self.corpus:
            raise ConfigError(f"--heldout-corpus {self.heldout_corpus} is the search corpus; held-out "
                              "perplexity must come from text the search never saw", "name a different text")
        if self.paper_bos not in PAPER_BOS:
            raise ConfigError(f"--paper-bos must be one of {', '.join(PAPER_BOS)}, got {self.paper_bos!r}")
        if self.paper_bos != "once" and self.objective != "paper":
            raise ConfigError(f"--paper-bos {self.paper_bos} applies to --objective paper only")

    def key_material(self) -> dict[str, Any]:
        d = super().key_material()
        d["alpha_grid"] = [round(float(a), 6) for a in self.alpha_grid]
        d["alphas"] = [round(float(a), 6) for a in self.alphas]
        if d.get("replacement") == "harp":  # the paper's plans keep the keys they had before fitted maps
            d.pop("replacement")
        if d.get("recover") == "none":  # and before recovery
            for k in ("recover", "recover_tokens", "recover_steps", "recover_lr"):
                d.pop(k, None)
        return d


STAGE = StageSpec("calibrate", "harp_trt.calib.stage:CalibrateStage", "harp_trt.calib.config:CalibrateConfig", "calibrate",
                  "score layers, choose P, search alpha (arXiv 2507.01900, Algorithm 1)")
