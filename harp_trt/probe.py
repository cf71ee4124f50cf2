"""Verification that scales: a truncated *probe* model, checked numerically, and a structural
check that ties every layer of the full graph to a verified one.

A 7B fp32 graph (30 GB) cannot run in one ONNX Runtime session on a 24 GB machine. What is
checked instead:

* the probe: a model folder written from the real checkpoint with only some layers (``probe_layers``:
  layer 0, the last layer, and the first middle layer of every form: kept, or pruned with a given
  alpha) and the first
  ``PROBE_VOCAB`` rows of the embedding and LM head, exported by the same code and rewritten by the
  same pass as the full graph, is compared numerically with the PyTorch HARP reference of that
  probe (``harp_trt.verify.verify_rewrite``: prefill, decode steps, greedy tokens);
* the structure: every layer of the full graph has the node structure (op, domain, attributes,
  constant-input dtypes and shapes) of the probe layer of its form and position (first, middle,
  last), and the rest of the graph (embedding, final norm, head) that of the probe's, with the
  vocabulary size as the only dimension allowed to differ (``check_structure``).

Verified at full size: structure. Verified numerically: the probe's layers with their real weights
and the rules that computed them. Inferred: that the same nodes over the other layers' weights
compute those layers (the rewrite computes every folded weight with the same code)."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import VerificationError

__all__ = ["PROBE_VOCAB", "probe_layers", "probe_alphas", "write_probe_folder", "layer_signatures",
           "check_structure"]

PROBE_VOCAB = 4096
_LAYER = re.compile(r"(?:^|[./_'\s])layers[._/](\d+)(?:[./_'\s]|$)")
_SCOPES = "pkg.torch.onnx.name_scopes"


def _role(i: int, n: int) -> str:
    # layer 0 and the last layer differ in structure from the middle ones (the exporter computes
    # shapes once, in layer 0, for every layer): each position is matched within its own kind
    return "first" if i == 0 else "last" if i == n - 1 else "middle"


def probe_layers(num_layers: int, alphas: Mapping[int, float]) -> list[int]:
    """Layer 0, the last layer and, among the middle layers, the first of every form (kept, or
    pruned with a given alpha), ascending."""
    first: dict[float | None, int] = {}
    for i in range(1, num_layers - 1):
        a = alphas.get(i)
        first.setdefault(None if a is None else float(a), i)
    return sorted({0, num_layers - 1, *first.values()})


def probe_alphas(layers: Sequence[int], alphas: Mapping[int, float]) -> dict[int, float]:
    """The plan's alphas on the probe's renumbered layers."""
    return {j: float(alphas[i]) for j, i in enumerate(layers) if i in alphas}


def probe_fitted(layers: Sequence[int], tensors: Mapping[str, Any], layer_prefix: str) -> dict[str, Any]:
    """The plan's fitted maps (``Plan.fitted_tensors``) renamed onto the probe's layers."""
    out = {}
    for j, i in enumerate(layers):
        old, new = layer_prefix.format(i=i), layer_prefix.format(i=j)
        out.update({new + k[len(old):]: v for k, v in tensors.items() if k.startswith(old)})
    return out


def write_probe_folder(src: Path, layers: Sequence[int], out: Path, vocab: int = PROBE_VOCAB) -> dict[str, Any]:
    """A Hugging Face folder holding ``layers`` of the model in ``src`` (renumbered 0..k-1, tensors
    copied at their stored dtype) and the first ``vocab`` rows of the embedding and LM head."""
    from .families import family_of
    from .weights import SafetensorsWriter, TensorSpec, WeightReader, hf_config

    cfg = json.loads((Path(src) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    reader = WeightReader(src)
    family = family_of(hf_config(src))
    vocab = min(vocab, int(text["vocab_size"]))
    heads = {family.weight_name("embed"), family.lm_head_name}
    where = {i: j for j, i in enumerate(layers)}
    plan: list[tuple[str, str, tuple[int, int] | None]] = []   # (new name, source name, rows)
    for name in reader.names():
        m = re.search(r"(^|\.)layers\.(\d+)\.", name)
        if m:
            i = int(m.group(2))
            if i in where:
                plan.append((name[:m.start(2)] + str(where[i]) + name[m.end(2):], name, None))
        elif name in heads:
            plan.append((name, name, (0, vocab)))
        else:
            plan.append((name, name, None))
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for new, old, rows in plan:
        spec = reader.spec(old)
        shape = (rows[1] - rows[0], *spec.shape[1:]) if rows else tuple(spec.shape)
        specs.append(TensorSpec(new, spec.dtype, shape))
    with SafetensorsWriter(out / "model.safetensors", specs) as w:
        for new, old, rows in plan:
            w.write(new, reader.get(old, rows=rows))
    text = {**text, "num_hidden_layers": len(layers), "vocab_size": vocab}
    for k in ("layer_types",):
        if isinstance(text.get(k), list):
            text[k] = [text[k][i] for i in layers]
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(text.get(k), int) and text[k] >= vocab:
            text[k] = None
    if "text_config" in cfg:
        cfg = {**cfg, "text_config": text}
    else:
        cfg = text
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"layers": list(layers), "vocab": vocab, "tensors": len(specs)}


def _layer_of(node) -> int | None:
    m = _LAYER.search(node.name or "")
    if m:
        return int(m.group(1))
    scopes = node.metadata_props.get(_SCOPES)
    if scopes:
        mods = [s for s in re.findall(r"'([^']*)'", scopes) if "layers" in s]
        if mods and (m := _LAYER.search(mods[-1])):
            return int(m.group(1))
    return None


def _node_signature(node, vocab: int) -> tuple:
    def dims(shape):
        return tuple("V" if d == vocab else (d if isinstance(d, int) else "?") for d in shape)

    ins = []
    for v in node.inputs:
        if v is None:
            ins.append(None)
        elif v.const_value is not None:
            ins.append((str(v.const_value.dtype), dims(v.const_value.shape)))
        else:
            ins.append("x")
    attrs = []
    for k, a in sorted(node.attributes.items()):
        val = a.value
        if hasattr(val, "numpy"):
            val = ("tensor", str(val.dtype), dims(val.shape))
        elif isinstance(val, (list, tuple)):
            val = tuple(val)
        attrs.append((k, repr(val)))
    return node.domain or "", node.op_type, tuple(attrs), tuple(ins)


def layer_signatures(model, vocab: int) -> dict[int | None, Counter]:
    """Per layer (None: outside every layer), the multiset of its nodes' signatures."""
    nodes = list(model.graph)
    where = {id(n): _layer_of(n) for n in nodes}
    for node in reversed(nodes):  # an unnamed node (a weight's Cast, a shape op) joins its readers' layer
        if where[id(node)] is None:
            readers = {where.get(id(u.node)) for o in node.outputs for u in o.uses()}
            if len(readers) == 1 and None not in readers:
                where[id(node)] = readers.pop()
    out: dict[int | None, Counter] = {}
    for node in nodes:
        out.setdefault(where[id(node)], Counter())[_node_signature(node, vocab)] += 1
    return out


def check_structure(full, probe_sig: Mapping[int | None, Counter], layers: Sequence[int], alphas: Mapping[int, float],
                    num_layers: int, vocab: int, stage: str) -> dict[str, Any]:
    """Every layer of ``full`` (an ``ir.Model``) against the probe layer of its form (``probe_sig``:
    the probe's ``layer_signatures``, taken before its file is removed); the rest against the
    probe's rest. Raises VerificationError naming the first layer that differs."""
    full_sig = layer_signatures(full, vocab)
    k = len(layers)
    by_form: dict[tuple, int] = {}
    for j, i in enumerate(layers):
        by_form.setdefault((_role(j, k), alphas.get(i)), j)
    checked: dict[str, list[int]] = {}
    for i in range(num_layers):
        a = alphas.get(i)
        j = by_form.get((_role(i, num_layers), a))
        if j is None:
            raise VerificationError(stage, f"layer {i} ({_role(i, num_layers)}, alpha {a}) has no probe layer of its form")
        if full_sig.get(i, Counter()) != probe_sig.get(j, Counter()):
            diff = (full_sig.get(i, Counter()) - probe_sig.get(j, Counter())) + \
                   (probe_sig.get(j, Counter()) - full_sig.get(i, Counter()))
            raise VerificationError(stage, f"layer {i} of the full graph differs in structure from the verified "
                                           f"probe layer {j} ({'kept' if a is None else f'alpha {a:g}'}): "
                                           f"{len(diff)} node signatures differ, e.g. {next(iter(diff))}"[:400],
                                    "the full graph and the probe were not rewritten by the same rules")
        checked.setdefault("kept" if a is None else f"alpha {a:g}", []).append(i)
    if full_sig.get(None, Counter()) != probe_sig.get(None, Counter()):
        raise VerificationError(stage, "the graph outside the layers (embedding, final norm, head) differs in "
                                       "structure from the verified probe's")
    return {"layers_checked": num_layers, "by_form": checked,
            "nodes": sum(sum(c.values()) for c in full_sig.values())}
