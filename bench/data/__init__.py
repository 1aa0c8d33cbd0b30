"""Batches for a model: synthetic ones of the right shape and label space (real data comes
later)."""
