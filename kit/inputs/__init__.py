"""What a config points at: built-in models, where model.name points, data files."""
