"""Rewrite 2: MXFP8 quantization around the sequence-parallel all-gather (being built)."""

from __future__ import annotations

NAME = "sp_gather"


def plan(graph, options):
    return [], []


def apply(graph, action, options):
    return None
