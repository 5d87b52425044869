"""GGUF tensor types: the one table of block geometry and traits (``table``) and the codebooks and block
formats it refers to (``iq_tables``, ``fp8_blocks``, ``nvfp4``).

Imports ``coli.base`` only; the CPU and device backends fill the table's ``backends`` column when imported.
"""
