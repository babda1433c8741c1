"""The recipe, rank side: what torchrun's ranks run to train (kit.train drives it), one step a
module; the levers a config opts into are kit/recipe/levers/."""
