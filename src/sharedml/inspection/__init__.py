"""``sharedml inspect``: what a model's sessions cost, plain against shared.

Measured in fresh processes: the static summary, findings, the report, the measuring parent
and child, and the strategies measured.
"""
