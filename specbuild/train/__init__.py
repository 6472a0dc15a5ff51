"""Distillation from the engine: the draft model, the Medusa heads, and the shared optimizer loop."""
