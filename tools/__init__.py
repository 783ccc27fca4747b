"""Maintenance scripts (`python tools/NAME.py`); a package so their tests can import them."""
