"""SessionPool: sessions that serve callers from any thread.

The pool's lifecycle, batching (merging and splitting requests, and the row-independence
analysis that decides whether they may merge), CUDA graphs and serialized runs.
"""
