"""Measurement only: the Spec-Bench runner, weight-format tables, drafter acceptance checks, the distribution check behind `specbuild verify`."""
