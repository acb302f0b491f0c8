"""Block masks (see the Semantics page): a user's mask function classified tile by tile,
built once and reused, so that the kernels skip the tiles it empties and evaluate it only on the
tiles it cuts.

:func:`create_block_mask` takes a :class:`cuflash.modifiers.MaskMod` and the sizes of
the calls it serves. On the GPU, one pass (``kernels/simt/classify_mask_cells.cu``, the
mask's functor compiled in) evaluates the mask on every (query, key) pair once and
records, for each cell of 16 query rows x 16 keys, whether the mask is true on any of
its elements and on all of them. Each kernel then reads the cells folded into its own
tiles (a *view*, made once per tile shape and cached): a tile is *empty* (no element
visible: skipped), *full* (every element visible: the mask is not evaluated) or
*partial* (the mask is evaluated element by element); and for each tile a block owns,
the range of tiles outside which every tile is empty, which the kernel's loop is
narrowed to.

The block mask holds the mask function: pass it as ``block_mask=`` to
:func:`cuflash.flash_attention_fwd` (and the backward and vjp) instead of ``mask_mod=``.
On the CPU path only its mask function is used. The classification is made on first GPU
use (or by :meth:`BlockMask.classify`) from the mask's arrays as they are then: a block
mask whose arrays change afterwards must be made again.

Examples
--------
>>> import numpy as np
>>> from cuflash.block_mask import create_block_mask
>>> from cuflash.modifiers import and_masks, causal_mask, document_mask
>>> doc_ids = np.repeat(np.arange(4, dtype=np.int32), 256)
>>> causal_documents = and_masks(document_mask(doc_ids), causal_mask())
>>> block_mask = create_block_mask(causal_documents, None, None, 1024, 1024)
>>> block_mask
BlockMask(..., batch=None, heads=None, q_len=1024, kv_len=1024)
>>> block_mask.cpu_classes(128, 128)[0, 0]  # 0 empty, 1 partial, 2 full
array([[1, 0, 0, 0, 0, 0, 0, 0],
       [2, 1, 0, 0, 0, 0, 0, 0],
       [0, 0, 1, 0, 0, 0, 0, 0],
       [0, 0, 2, 1, 0, 0, 0, 0],
       [0, 0, 0, 0, 1, 0, 0, 0],
       [0, 0, 0, 0, 2, 1, 0, 0],
       [0, 0, 0, 0, 0, 0, 1, 0],
       [0, 0, 0, 0, 0, 0, 2, 1]], dtype=uint8)
"""

# The code is cuflash.modifiers.block_mask; this module keeps the public name and the docs.
from .modifiers.block_mask import CELL, EMPTY, FULL, PARTIAL, BlockMask, create_block_mask

__all__ = ["create_block_mask", "BlockMask", "EMPTY", "PARTIAL", "FULL", "CELL"]
