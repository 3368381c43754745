"""Worked examples of fmoe's seams (docs/research.md): modules a run names by import path."""
