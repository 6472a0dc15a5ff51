"""What to draft: SpeculationConfig, token trees, the Medusa heads, the speculator (draft -> verify -> accept), depth control, and one proposer per drafter in proposers/."""
