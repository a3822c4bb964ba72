"""The rules, one module per operator family: importing this package registers every rule."""

from sharedml.rows.ops import (
    _attention,
    _control,
    _conv,
    _elementwise,
    _indexing,
    _linear,
    _ml,
    _norm,
    _quant,
    _random,
    _recurrent,
    _reduce,
    _shape,
)

FAMILIES = (
    _attention,
    _control,
    _conv,
    _elementwise,
    _indexing,
    _linear,
    _ml,
    _norm,
    _quant,
    _random,
    _recurrent,
    _reduce,
    _shape,
)
"""The op families' modules, each of which registers its rules when it is imported."""
