"""Row independence: whether a model may merge callers' requests into one batch.

The analysis that follows the inputs' axis 0 through every node of a graph, and the symbolic
dims it follows shapes with.
"""
