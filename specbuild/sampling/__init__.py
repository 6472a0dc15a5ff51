"""Sampling parameters, logit warping, and the acceptance rules (chain, tree, typical) that keep speculative output the target's distribution."""
