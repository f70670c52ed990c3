"""eric_epd.eric package."""
