"""Family tables: the one sliding-window rule (``FamilySpec.layer_windows``) equals the windows
transformers' own models run with, per family; the TensorRT-LLM facts are plain data the builders
read; and the modules that consume the tables never branch on family or architecture names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from harp_trt.dims import ModelDims
from harp_trt.families import FAMILIES, ROUTE_LINEAR, TrtllmTarget

from conftest import ALL_FAMILIES, FAMILY_NAMES

ROOT = Path(__file__).resolve().parents[1]
T, W = 12, 3  # sequence length, sliding window (< T, so a window shows in the mask)

# family -> (config overrides, the windows transformers runs each of the 4 layers with)
WINDOW_CASES = {
    "llama": ({}, (None,) * 4),
    "mistral": ({"sliding_window": W}, (W,) * 4),                               # every layer
    "qwen2": ({"use_sliding_window": True, "sliding_window": W, "max_window_layers": 2},
              (None, None, W, W)),                                              # layers >= max_window_layers
    "gemma2": ({"sliding_window": W}, (W, None, W, None)),                      # even layers
    "qwen3": ({"use_sliding_window": True, "sliding_window": W, "max_window_layers": 2},
              (None, None, W, W)),                                              # as Qwen2
    "gemma3": ({"sliding_window": W}, (W, W, None, W)),                         # its layer_types (5:1)
}


def _transformers_windows(family: str, **overrides) -> tuple[int | None, ...]:
    """Per layer, how many keys the last query may see in the mask transformers hands the
    layer's attention (eager, so the mask is materialised); None when it sees all T."""
    from transformers import AutoModelForCausalLM

    spec = FAMILIES.get(family)()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(spec.tiny_config(**overrides), attn_implementation="eager").eval()
    seen: dict[int, int | None] = {}

    def hook(i):
        def capture(_module, args, kwargs):
            mask = kwargs["attention_mask"][0, 0, -1]
            allowed = int(mask.sum()) if mask.dtype == torch.bool else int((mask == 0).sum())
            seen[i] = None if allowed == T else allowed
        return capture

    for i, layer in enumerate(spec.layers(model)):
        layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
    with torch.no_grad():
        model(torch.arange(T)[None])
    return tuple(seen[i] for i in range(len(seen)))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_layer_windows_equal_the_masks_transformers_builds(family):
    overrides, want = WINDOW_CASES[family]
    spec = FAMILIES.get(family)()
    cfg = spec.tiny_config(**overrides)
    assert _transformers_windows(family, **overrides) == want
    assert spec.layer_windows(cfg) == want
    assert ModelDims.from_config(cfg).windows == want  # every stage reads this one rule
    types = getattr(cfg, "layer_types", None)
    if types and family != "mistral":  # where the config has layer types, they say the same
        assert [t == "sliding_attention" for t in types] == [w is not None for w in want]


def test_qwen2_without_use_sliding_window_has_no_window():
    overrides = {"use_sliding_window": False, "sliding_window": W, "max_window_layers": 2}
    spec = FAMILIES.get("qwen2")()
    assert _transformers_windows("qwen2", **overrides) == (None,) * 4
    assert spec.layer_windows(spec.tiny_config(**overrides)) == (None,) * 4


def test_mistral_window_applies_to_every_layer_whatever_layer_types_say():
    spec = FAMILIES.get("mistral")()
    overrides = {"sliding_window": W, "layer_types": ["full_attention", "sliding_attention"] * 2}
    assert _transformers_windows("mistral", **overrides) == (W,) * 4  # MistralModel ignores layer_types
    assert spec.layer_windows(spec.tiny_config(**overrides)) == (W,) * 4
    assert ModelDims.from_config(spec.tiny_config(**overrides)).windows == (W,) * 4
    assert spec.layer_windows(spec.tiny_config(sliding_window=None)) == (None,) * 4


def test_attn_implementation_is_the_callers_unless_the_family_requires_its_own():
    llama, gemma2 = FAMILIES.get("llama")(), FAMILIES.get("gemma2")()
    assert llama.attn_implementation_for(None) == "sdpa" and llama.attn_implementation_for("eager") == "eager"
    assert gemma2.attn_implementation_for(None) == "eager" and gemma2.attn_implementation_for("sdpa") == "eager"


# ---- TensorRT-LLM facts -------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_trtllm_facts_are_plain_data_the_writer_reads(family):
    """The writer's facts are the family's data. The reader does not share them: it knows each
    architecture from its own table (builders/trtllm/trtllm_models.py), and test_trtllm_oracle.py
    changes these facts alone to see the golden comparison fail."""
    from harp_trt.builders.trtllm.reader import SUPPORTED_ARCHITECTURES
    from harp_trt.builders.trtllm.targets import target_for
    from harp_trt.builders.trtllm.trtllm_models import MODELS

    spec = FAMILIES.get(family)()
    t = spec.trtllm
    assert isinstance(t, TrtllmTarget) and target_for(family) is t
    assert t.layer_configs == (t.route == ROUTE_LINEAR) == t.hf_heterogeneous
    assert t.inter_layernorms == bool(spec.extra_layer_norms)
    assert t.architecture in SUPPORTED_ARCHITECTURES  # the oracle can read every family's checkpoint
    assert MODELS[t.architecture].heterogeneous == t.layer_configs  # per-layer configs only where TensorRT-LLM reads them


def test_family_tables_import_no_builder():
    for f in (ROOT / "harp_trt" / "families").glob("*.py"):
        tree = ast.parse(f.read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m.startswith(("builders", "harp_trt.builders"))], f.name


TABLE_READERS = ["harp_trt/models.py", "harp_trt/dims.py", "builders/trtllm/checkpoint.py",
                 "builders/trtllm/reader.py", "builders/trtllm/trtllm_models.py", "builders/trtllm/hf_format.py",
                 "builders/trtllm/targets.py",
                 "calib/strategies/gate_norm.py"]


@pytest.mark.parametrize("path", TABLE_READERS)
def test_no_branch_on_family_or_architecture_names(path):
    names = set(ALL_FAMILIES) | {FAMILIES.get(f).trtllm.architecture for f in FAMILY_NAMES}
    names |= {"eager", "sdpa", "LlamaForCausalLM", "MistralForCausalLM"}
    tree = ast.parse((ROOT / path).read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                bad += [(node.lineno, c.value) for c in consts
                        if isinstance(c, ast.Constant) and c.value in names]
    assert not bad, f"{path} compares against family / architecture names: {bad}"


def test_a_family_is_a_file_found_by_the_registry(tmp_path):
    """Every module of harp_trt/families but base is one family, registered under its file's name,
    which is the family's ``name``; the registry finds a new file without a line added anywhere."""
    import sys

    from harp_trt.families import FAMILIES
    from harp_trt.families.base import FamilySpec
    from harp_trt.lazy import Registry

    assert FAMILIES.names() == ["gemma2", "gemma3", "llama", "mistral", "qwen2", "qwen3"]
    assert all(FAMILIES.get(n).name == n and issubclass(FAMILIES.get(n), FamilySpec) for n in FAMILIES.names())
    pkg = tmp_path / "fams"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_private.py").write_text("")
    (pkg / "newfam.py").write_text("FAMILY = 'the new one'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        found = Registry("model family")
        found.register_package("fams", "FAMILY")
        assert found.names() == ["newfam"] and found.get("newfam") == "the new one"
    finally:
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m == "fams" or m.startswith("fams.")]:
            del sys.modules[m]
