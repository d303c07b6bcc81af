"""Tests of the scale harness (e2e/scale)."""
