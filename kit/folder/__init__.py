"""The run folder, both sides and torch-free: its files, what a start may do, manifests."""
