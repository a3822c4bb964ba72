"""The installed onnxruntime.

What it can do (capabilities, probed once per process), its execution providers, and the
session options sharedml copies and sets.
"""
