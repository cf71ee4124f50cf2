"""The protocol of a graph-rewrite rule, shared by the rewrite stage's HARP rules
(``harp_trt/rewrite/rules/``) and the ORT build's GroupQueryAttention fusion
(``builders/ort/gqa.py``). It lives in core because stages never import each other.

A rule is one class (after onnxscript's ``RewriteRuleClassBase``):

* ``pattern``: where to look, the candidate nodes;
* ``check``: the structural match for one candidate, or the reason there is none (a falsy
  ``MatchResult``, so a pass can report why a candidate was left alone);
* ``rewrite``: apply one match, returning what it added.

A pass drives its rules and reports what they matched and changed: ``HarpRewritePass``
(``harp_trt/rewrite/passes.py``) and ``FuseGroupQueryAttentionPass`` (``builders/ort/passes.py``).
The arguments after the graph are the rule kind's own (a HARP rule works on one layer with one
alpha), as in onnxscript, whose ``pattern``/``check``/``rewrite`` take the pattern's variables."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["GraphRule", "MatchResult"]

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
    ``pattern`` / ``check`` / ``rewrite``."""

    name: ClassVar[str]
    description: ClassVar[str]

    def pattern(self, graph: Any, *args: Any) -> Any:
        """The candidates to ``check`` in ``graph``."""
        raise NotImplementedError

    def check(self, graph: Any, candidate: Any, *args: Any) -> MatchResult[M]:
        """The match for ``candidate``, or ``MatchResult.fail(reason)``."""
        raise NotImplementedError

    def rewrite(self, graph: Any, match: M, *args: Any) -> Any:
        """Apply ``match`` to ``graph`` in place; returns what was added."""
        raise NotImplementedError
