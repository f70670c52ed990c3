"""eric_epd.server package."""
