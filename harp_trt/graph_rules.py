"""The protocol of a graph-rewrite rule, shared by the rewrite stage's HARP rules
(``harp_trt/rewrite/rules/``) and the ORT build's GroupQueryAttention fusion
(``builders/ort/gqa.py``). It lives in core because stages never import each other.

A rule is one class (after onnxscript's ``RewriteRuleClassBase``):

* ``pattern``: where to look, the candidate nodes;
* ``check``: the structural match for one candidate, or the reason there is none (a falsy
  ``MatchResult``, so a pass can report why a candidate was left alone);
* ``rewrite``: apply one match, returning what it added.

One driver runs a rule over a graph: ``RulePass`` (an onnx-ir ``InPlacePass``) checks every
candidate, rewrites every match, and returns a ``RuleResult``, a ``PassResult`` that carries the
``RuleReport`` (what was matched, what was left and why); ``run_passes`` runs a list of passes in
order and hands back each one's report by name, so no caller fishes reports off pass objects. The
ORT build's rules run this way (``builders/ort/passes.py``); the rewrite stage's HARP rules work
per layer with one alpha and are driven by ``HarpRewritePass`` (``harp_trt/rewrite/passes.py``),
which matches every layer before it changes any. The arguments after the graph are the rule kind's
own, as in onnxscript, whose ``pattern``/``check``/``rewrite`` take the pattern's variables."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Sequence, TypeVar

import onnx_ir.passes as ir_passes

__all__ = ["GraphRule", "MatchResult", "RuleReport", "RuleResult", "RulePass", "run_passes"]

log = logging.getLogger(__name__)

M = TypeVar("M")


@dataclass
class MatchResult(Generic[M]):
    """A match, or the reason there is none (falsy)."""

    match: M | None = None
    reason: str = ""

    def __bool__(self) -> bool:
        return self.match is not None

    @classmethod
    def fail(cls, reason: str) -> "MatchResult[M]":
        return cls(None, reason)


class GraphRule(Generic[M]):
    """Base of every rule: ``name`` (what reports call it), ``description`` (what it matches), and
    ``pattern`` / ``check`` / ``rewrite``. For ``RulePass``: ``key``, the name its report goes by
    (the engine's field); ``must_match``, whether a candidate that does not match fails the graph
    (``fail_hint`` says what to do) rather than being left alone; ``first_only``, stop after one
    match; and ``describe`` / ``finish`` / ``summary``, what the report holds."""

    name: ClassVar[str]
    description: ClassVar[str]
    key: ClassVar[str] = ""
    must_match: ClassVar[bool] = False
    first_only: ClassVar[bool] = False
    fail_hint: ClassVar[str] = ""

    def name_of(self, candidate: Any) -> str:
        """What the report calls a candidate left alone."""
        return getattr(candidate, "name", None) or "?"

    def describe(self, match: M, added: Any) -> Any:
        """What the report lists for one applied match (default: the match)."""
        return match

    def finish(self, model: Any, report: "RuleReport") -> None:
        """After the last rewrite: what the graph needs once (an opset import), totals into
        ``report.extra``."""

    def summary(self, report: "RuleReport") -> Any:
        """The report as the artifact records it."""
        return {"rule": report.rule, "matched": report.matched, "skipped": report.skipped, **report.extra}

    def pattern(self, graph: Any, *args: Any) -> Any:
        """The candidates to ``check`` in ``graph``."""
        raise NotImplementedError

    def check(self, graph: Any, candidate: Any, *args: Any) -> MatchResult[M]:
        """The match for ``candidate``, or ``MatchResult.fail(reason)``."""
        raise NotImplementedError

    def rewrite(self, graph: Any, match: M, *args: Any) -> Any:
        """Apply ``match`` to ``graph`` in place; returns what was added."""
        raise NotImplementedError


# ---- the driver ------------------------------------------------------------------------------------
@dataclass
class RuleReport:
    """What one rule did to a graph: ``matched``, each applied match as ``describe`` put it;
    ``skipped``, each candidate left alone (by name) and why; ``extra``, what ``finish`` added."""

    rule: str
    matched: list[Any] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RuleResult(ir_passes.PassResult):
    """A ``PassResult`` with the pass's report: ``key`` (what it is recorded under) and ``report``
    (the rule's ``summary``, or whatever a pass that is no rule reports)."""

    key: str = ""
    report: Any = None


class RulePass(ir_passes.InPlacePass):
    """The one driver of a ``GraphRule``: ``pattern`` -> ``check`` -> ``rewrite`` for every candidate,
    then ``finish``; returns a ``RuleResult`` whose report is the rule's ``summary``. A candidate that
    does not match is recorded with its reason or, for a ``must_match`` rule, raised as the typed
    ``GraphError`` of ``stage`` naming the candidate and the reason."""

    def __init__(self, rule: GraphRule, stage: str = "build"):
        super().__init__()
        self.rule, self.stage = rule, stage

    def call(self, model: Any) -> RuleResult:
        rule, graph = self.rule, model.graph
        report = RuleReport(rule.name)
        for candidate in rule.pattern(graph):
            found = rule.check(graph, candidate)
            if not found:
                if rule.must_match:
                    from .errors import GraphError

                    raise GraphError(self.stage, f"{rule.name} found no match at {rule.name_of(candidate)}: "
                                     f"{found.reason}", rule.fail_hint)
                report.skipped[rule.name_of(candidate)] = found.reason
                continue
            report.matched.append(rule.describe(found.match, rule.rewrite(graph, found.match)))
            if rule.first_only:
                break
        rule.finish(model, report)
        log.info("%s: %d applied, %d left alone", rule.name, len(report.matched), len(report.skipped))
        for name, why in report.skipped.items():
            log.debug("  %s left %s: %s", rule.name, name, why)
        return RuleResult(model, modified=bool(report.matched), key=rule.key or rule.name, report=rule.summary(report))


def run_passes(passes: Sequence[ir_passes.PassBase], model: Any) -> tuple[Any, dict[str, Any]]:
    """Run ``passes`` in order, as onnx-ir's ``Sequential`` does, and return the model with every
    ``RuleResult``'s report by its key. A harp-trt error raised inside a pass comes out as itself;
    any other error as onnx-ir's ``PassError`` naming the pass."""
    from .errors import HarpError

    reports: dict[str, Any] = {}
    for p in passes:
        try:
            result = p(model)
        except HarpError:  # typed, whether or not it is also onnx-ir's Pre/PostconditionError
            raise
        except ir_passes.PassError as e:
            if isinstance(e.__cause__, HarpError):
                raise e.__cause__ from None
            raise
        except Exception as e:
            raise ir_passes.PassError(f"an error occurred when running the '{p.__class__.__name__}' pass") from e
        model = result.model
        if isinstance(result, RuleResult):
            reports[result.key] = result.report
    return model, reports
