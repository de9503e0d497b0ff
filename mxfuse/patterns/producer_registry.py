"""Every producer recognizer, tried in order: :data:`PRODUCER_RECOGNIZERS`, :func:`match_producer`,
:func:`find_producers`.

Apart from :mod:`.producers` (the contract the recognizer modules import) so that no import
circle forms: this module imports the recognizers, they import the contract. A new producer
appends one :class:`Recognizer` here: its match function and the nodes it can anchor at (so that
a graph is not matched node by node).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

from torch import fx

from mxfuse.patterns.act_mul import act_mul_candidates, match_act_mul
from mxfuse.patterns.gated import gate_candidates, match_gate
from mxfuse.patterns.gated_norm import fla_candidates, gated_norm_candidates, match_fla_gated_norm, match_gated_norm
from mxfuse.patterns.norms import match_norm, norm_candidates
from mxfuse.patterns.producers import ProducerMatch


class Recognizer(NamedTuple):
    """One family's recognizer: `match(y)` (the producer whose output `y` is, or None) and
    `candidates(graph)` (a superset of the nodes `match` can return a producer for)."""

    match: Callable[[fx.Node], ProducerMatch | None]
    candidates: Callable[[fx.Graph], Collection[fx.Node]]


PRODUCER_RECOGNIZERS: tuple[Recognizer, ...] = (
    Recognizer(match_norm, norm_candidates),
    Recognizer(match_gate, gate_candidates),
    Recognizer(match_gated_norm, gated_norm_candidates),
    Recognizer(match_fla_gated_norm, fla_candidates),
    Recognizer(match_act_mul, act_mul_candidates),
)
"""Tried in order; the first match wins."""


def match_producer(y: fx.Node) -> ProducerMatch | None:
    """The producer whose output `y` is, of any family and form; None if `y` is not one."""
    for recognizer in PRODUCER_RECOGNIZERS:
        found = recognizer.match(y)
        if found is not None:
            return found
    return None


def find_producers(graph: fx.Graph) -> list[ProducerMatch]:
    """Every producer output in the graph, in graph order."""
    candidates = set().union(*(r.candidates(graph) for r in PRODUCER_RECOGNIZERS))
    found = (match_producer(node) for node in graph.nodes if node in candidates)
    return [m for m in found if m is not None]
