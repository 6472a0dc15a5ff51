"""Attention plugins: masks (causal, tree), packed masks, and the attention op.

Imports nothing of specbuild.runtime or specbuild.build (DESIGN.md layering).
"""
