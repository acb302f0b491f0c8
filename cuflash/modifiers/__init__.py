"""User-defined score and mask modifiers (see the Semantics page): one Python definition for every path.

A *score modifier* is a function ``(score, b, h, q_idx, kv_idx) -> score`` that
rewrites each scaled score ``s = softmax_scale * q . k`` before the softmax; a
*mask modifier* is a function ``(b, h, q_idx, kv_idx) -> bool`` that says which
keys a query sees. ``b`` is the batch entry, ``h`` the query head, ``q_idx``
the query row and ``kv_idx`` the key, all counted from 0 (no bottom-right
alignment is applied: a modifier that wants it adds ``kv_len - q_len`` itself,
as the ``offset`` of the factories below does).

:class:`ScoreMod` and :class:`MaskMod` read the function's source and
translate it, once, into

* a C++ functor (``cxx_source``, a ``struct`` named after a hash of its
  code) that the GPU kernels compile in through NVRTC, with
  ``grad()``, the derivative of the new score with respect to the old one,
  derived symbolically for the backward pass;
* a NumPy evaluator (:meth:`ScoreMod.numpy_scores`, :meth:`ScoreMod.numpy_grad`,
  :meth:`MaskMod.numpy_mask`) over broadcast index grids, in float32 for the
  CPU path and in float64 for the oracle.

The function itself still runs as plain Python on scalars (call the modifier
object), which is how the tests hold the translations to it.

*The language.* A function body is a sequence of ``name = expr`` (also ``+=`` and friends),
``if``/``else`` blocks and ``return expr``. Expressions use the parameters,
locals, numbers (Python ``int``, ``float``, ``bool``, ``math.inf``,
``float('inf')``), ``+ - * / // % **`` (``**`` with a constant integer
exponent from 0 to 8; ``//`` and ``%`` on integers, with Python's floor
semantics; ``x // 0`` and ``x % 0`` are 0), comparisons (chained too),
``and``/``or``/``not`` on conditions, ``a if c else b`` and the functions
``where``, ``tanh``, ``exp``, ``log``, ``sqrt``, ``abs``, ``minimum`` and
``maximum`` of this module (``math.``,
``numpy.`` and the builtins ``abs``, ``min``, ``max`` of two arguments are
accepted for them). Another modifier object may be called; its code is
inlined. Both branches of a condition are evaluated (there is no
short-circuit), and every array read is checked as if both ran.

Numbers captured from the enclosing scope (closure variables, globals) are
baked into the generated code, so they are part of its cache key; they, and
the arrays, are captured when the modifier is made. Arrays are read with
integer index expressions, one index per axis: up to 4 arrays, each at most
4-D, of dtype int32, int64, float32 or bool, NumPy or CuPy, any strides; a 0-d
array may be used without an index (a run-time scalar that is not part of the
cache key). Arrays are captured by closure or global, or bound by keyword:
``ScoreMod(fn, bias=table)`` makes the name ``bias`` in ``fn`` mean
``table``.

Arithmetic follows the kernels: floats are float32 (the float64 evaluator
computes the same expression in float64), integers are int32, or int64 once
an int64 array value or a constant beyond int32 takes part; ``minimum`` and
``maximum`` of floats ignore a NaN operand (C's ``fminf``, NumPy's ``fmin``).
Array indices never wrap: :meth:`Modifier.check_bounds` rejects, before any
work, a modifier whose indices, computed from ``b``, ``h``, ``q_idx``,
``kv_idx`` and constants, could leave an array for the call's sizes (interval
arithmetic), or whose int32 arithmetic could overflow. An index computed from
an array's *values* (``bias[doc[q_idx]]``) cannot be bounded in advance: the
kernels clamp it into the axis (they clamp every index, so that no read can
leave a buffer), while the NumPy evaluator raises
``InvalidArgumentError`` when one is out of range.

Arrays may be NumPy or CuPy. The NumPy evaluators copy CuPy arrays to the
host; :meth:`Modifier.kernel_arguments` for the GPU takes CuPy arrays on the
current device only and refuses NumPy ones (nothing is copied to a device
behind the caller's back): make a modifier for the GPU with CuPy arrays.

Masked entries are ``-inf`` scores; the derivative is 0 wherever the new
score is ``-inf``. Results of the three evaluators agree to a few float32 units
in the last place (the kernels may fuse a multiply and an add, and their
``tanhf`` is not NumPy's).

*The kernel interface.* :data:`MODIFIER_PRELUDE` (no header needed under NVRTC) defines
``ModifierArrays`` (per slot: element pointer, strides and shape in elements;
a kernel takes it by value, packed by :meth:`Modifier.kernel_arguments` as
:data:`MODIFIER_ARRAYS_DTYPE`), the helpers the functors call, and the
identities ``NoScoreMod`` and ``NoMaskMod``. Each functor (after the prelude
in the translation unit) is an empty struct with ``is_identity = false`` and

* ``float operator()(float score, int b, int h, int q_idx, int kv_idx,
  const ModifierArrays& arrays) const`` and ``float grad(...)`` (score), or
* ``bool operator()(int b, int h, int q_idx, int kv_idx,
  const ModifierArrays& arrays) const`` (mask),

all ``__host__ __device__``: a kernel takes it as a template parameter.
:meth:`Modifier.check_bounds` must pass for the call's sizes before a launch.

Examples
--------
>>> import numpy as np
>>> from cuflash.modifiers import MaskMod, ScoreMod, index_grids, tanh
>>> doc = np.array([0, 0, 1, 1, 1], dtype=np.int32)
>>> def same_document(b, h, q_idx, kv_idx):
...     return doc[q_idx] == doc[kv_idx] and kv_idx <= q_idx
>>> mask = MaskMod(same_document)
>>> b, h, q_idx, kv_idx = index_grids(1, 1, 5, 5)
>>> mask.numpy_mask(b, h, q_idx, kv_idx)[0, 0].astype(int)
array([[1, 0, 0, 0, 0],
       [1, 1, 0, 0, 0],
       [0, 0, 1, 0, 0],
       [0, 0, 1, 1, 0],
       [0, 0, 1, 1, 1]])
>>> mask(0, 0, 4, 2)  # still a Python function
True
>>> cap = 2.0
>>> soft = ScoreMod(lambda score, b, h, q_idx, kv_idx: cap * tanh(score / cap))
>>> scores = np.array([-3.0, 0.5, 8.0], dtype=np.float32)
>>> soft.numpy_scores(scores, 0, 0, 0, 0)
array([-1.8102..., 0.4898..., 1.9986...], dtype=float32)
>>> soft.numpy_grad(scores, 0, 0, 0, 0)
array([0.1807..., 0.9400..., 0.0013...], dtype=float32)
>>> soft.struct_name.startswith("UserScoreMod_"), len(soft.cache_key)
(True, 64)
>>> mask.check_bounds(1, 1, 5, 6)
Traceback (most recent call last):
    ...
cuflash.errors.InvalidArgumentError: mask_mod: same_document reads doc[kv_idx] with axis-0 indices in [0, 5] ...
"""


# The package: a user layer over a small compiler of the user's functions, kept apart
# as torch's flex_attention keeps them.
#
# The language:
#   functions.py   where, tanh, exp, log, sqrt, abs, minimum, maximum
# User layer:
#   api.py         Modifier, ScoreMod, MaskMod (one translation each), index_grids
#   factories.py   causal_mask, document_mask, ... relative_bias_score
#   block_mask.py  BlockMask, create_block_mask (cuflash.block_mask re-exports them)
# Compiler:
#   source.py      the function's def or lambda syntax tree in its source file
#   frontend.py    Python syntax tree -> expression graph (the Translator)
#   ir.py          the interned expression graph, its constructors and walks
#   derivative.py  d(score modifier)/d(score), symbolically
#   bounds.py      interval arithmetic on integer nodes (Modifier.check_bounds)
#   cxx.py         the C++ functor, MODIFIER_PRELUDE, MODIFIER_ARRAYS_DTYPE
#   numpy_eval.py  the NumPy evaluator's source
# The compiler modules import each other and functions.py only, never the user layer.
# block_mask.py is not imported here: it imports cuflash.gpu.kernel_build, which imports
# this package (for MODIFIER_PRELUDE).

from . import cxx
from .api import MaskMod, Modifier, ScoreMod, index_grids
from .factories import (
    alibi_score,
    and_masks,
    causal_mask,
    chunked_mask,
    document_mask,
    or_masks,
    prefix_lm_mask,
    relative_bias_score,
    softcap_score,
)
from .functions import abs, exp, log, maximum, minimum, sqrt, tanh, where
from .ir import MAX_ARRAY_NDIM, MAX_ARRAYS, MAX_POWER  # noqa: F401 - MAX_POWER: not in __all__

# Assigned, not imported, so that their #: comments document them here (Sphinx reads
# a data member's description from the module that is documented).

#: C++ that every functor needs before it: ``ModifierArrays``, the helpers the functors
#: call, ``NoScoreMod`` and ``NoMaskMod``.
MODIFIER_PRELUDE = cxx.MODIFIER_PRELUDE

#: The layout of ``ModifierArrays`` (:data:`MODIFIER_PRELUDE`): a kernel argument passed
#: by value, as :meth:`Modifier.kernel_arguments` packs it.
MODIFIER_ARRAYS_DTYPE = cxx.MODIFIER_ARRAYS_DTYPE

__all__ = [
    "Modifier",
    "ScoreMod",
    "MaskMod",
    "index_grids",
    "MODIFIER_PRELUDE",
    "MODIFIER_ARRAYS_DTYPE",
    "MAX_ARRAYS",
    "MAX_ARRAY_NDIM",
    "where",
    "tanh",
    "exp",
    "log",
    "sqrt",
    "abs",
    "minimum",
    "maximum",
    "causal_mask",
    "document_mask",
    "prefix_lm_mask",
    "chunked_mask",
    "and_masks",
    "or_masks",
    "softcap_score",
    "alibi_score",
    "relative_bias_score",
]
