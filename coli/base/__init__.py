"""The floor of coli: errors, settings, cache paths and progress lines.

Every package may import it; it imports nothing else of the project (tests/test_layers.py).
"""
