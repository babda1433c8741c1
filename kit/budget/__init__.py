"""Memory and speed from a model's shape and this machine, before anything runs."""
