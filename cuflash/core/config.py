"""The options of one attention call, as one frozen object.

Every front end (the dense, packed and KV-cache calls and the ring) builds an
:class:`AttentionConfig` of the options it was given when its launch plan is missed
(a plan hit needs none: the plan's signature holds the same values), and the
validation (:mod:`cuflash.core.problem`) takes that object rather than the options one
keyword at a time.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The non-array arguments of one attention call.

    Attributes
    ----------
    num_heads, num_kv_heads, head_dim : int
    causal : bool
    window_size : int or (int, int)
    kv_seq_len : int or None
    softmax_scale : float or None
    allow_tf32 : bool
    softcap : float
    alibi_slopes : array or None
    score_mod, mask_mod, block_mask : cuflash.modifiers, cuflash.block_mask objects or None
    sinks : array or None
    head_dim_v : int or None
        As passed to :func:`flash_attention_vjp`.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = False
    window_size: object = 0
    kv_seq_len: object = None
    softmax_scale: object = None
    allow_tf32: bool = False
    softcap: float = 0.0
    alibi_slopes: object = None
    score_mod: object = None
    mask_mod: object = None
    block_mask: object = None
    sinks: object = None
    head_dim_v: object = None

    def keywords(self):
        """The options the calls take by keyword, ``softmax_scale`` to ``head_dim_v``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[6:]}
