"""The recipe, rank side: what torchrun's ranks run to train (kit.train drives it)."""
