"""Profiles and plans: what Eric and the engine do on given devices, and the split that serves a traffic mix best."""
