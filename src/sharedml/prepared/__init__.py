"""Prepared models: what prepare writes.

Every weight of a model (or a family of models) in one aligned, verified file beside a small
graph: the plan, the weights-file format, the writer, families, and the tensors shared with
other cache entries.
"""
