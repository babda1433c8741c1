"""The notebooks' instruments: experiments each notebook runs (nothing outside lab imports them)."""
