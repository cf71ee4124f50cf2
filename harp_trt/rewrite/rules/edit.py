"""Graph edits the HARP rewrite makes: fresh value names, new nodes, and the residual add that
stops adding a block (alpha = 0)."""
from __future__ import annotations

import onnx_ir as ir

__all__ = ["unique_name", "add_node", "remove_block"]


def unique_name(graph: ir.Graph, name: str) -> str:
    taken = graph.meta.setdefault("harp_names", None)
    if taken is None:
        taken = {v.name for n in graph for v in n.outputs} | set(graph.initializers) | \
            {v.name for v in graph.inputs}
        graph.meta["harp_names"] = taken
    base, k = name, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def add_node(graph: ir.Graph, acc: list[ir.Node], op: str, inputs: list[ir.Value], name: str) -> ir.Value:
    n = ir.node(op, inputs, name=name)
    n.outputs[0].name = unique_name(graph, f"{name}_output_0")
    acc.append(n)
    return n.outputs[0]


def remove_block(graph: ir.Graph, n: ir.Node, residual: ir.Value, prefix: str) -> list[str]:
    """alpha = 0: the residual node ``n`` stops adding the block to ``residual`` (HARP with
    alpha_l = 0). Returns the names of the nodes added."""
    added: list[str] = []
    if n.op_type == "Add":
        out = n.outputs[0]
        if out.is_graph_output():
            ident = ir.node("Identity", [residual], name=f"{prefix}/residual/Identity")
            graph.insert_after(n, [ident])
            out.replace_all_uses_with(ident.outputs[0], replace_graph_outputs=True)
            added.append(ident.name)
        else:
            out.replace_all_uses_with(residual)
        return added
    # fused Skip*Norm: out0 = norm(h + block), out3 = h + block  ->  norm(h), h
    eps = n.attributes.get_float("epsilon", 1e-5)
    opset = graph.opset_imports.get("", 0)
    if n.op_type == "SkipSimplifiedLayerNormalization":
        op, domain, ins = ("RMSNormalization", "", [residual, n.inputs[2]]) if opset >= 23 else \
            ("SimplifiedLayerNormalization", "", [residual, n.inputs[2]])
    else:
        op, domain = "LayerNormalization", ""
        ins = [residual, n.inputs[2]] + ([n.inputs[3]] if len(n.inputs) > 3 and n.inputs[3] is not None else [])
    norm = ir.node(op, ins, attributes={"epsilon": eps, "axis": -1}, domain=domain,
                   name=f"{prefix}/residual/{op}")
    norm.outputs[0].name = unique_name(graph, f"{prefix}/residual/{op}_output_0")
    graph.insert_after(n, [norm])
    n.outputs[0].replace_all_uses_with(norm.outputs[0], replace_graph_outputs=True)
    if len(n.outputs) > 3 and n.outputs[3] is not None:
        n.outputs[3].replace_all_uses_with(residual)
    added.append(norm.name)
    return added
