"""The KV-cache kernels' parameter records: the split-KV decode's ``DecodeParams``, the
append's ``KvcacheAppendParams`` and the combine's ``KvcacheCombineParams``, laid out
from ``kernels/common/params.cuh`` by :class:`cuflash.gpu.kernel_params.Params`.
"""

from .kernel_params import LOG2E, Params

#: The members of ``DecodeParams`` (the KV cache's split-KV kernels) a launch writes at
#: each call, in order.
DECODE_ADDRESSES = (
    "q",
    "k_cache",
    "v_cache",
    "seqlens",
    "block_table",
    "out",
    "lse",
    "part_out",
    "part_lse",
    "alibi_slopes",
    "sinks",
    "qk_scales",  # an FP8 cache's descale arrays (q's times k's, v's), or 0
    "v_scales",
    "seqlen_value",  # an int: the lengths' value where seqlens is null
)


def _paging(problem):
    return dict(
        capacity=problem.capacity,
        block_size=problem.block_size,
        max_blocks=problem.max_blocks,
        num_blocks=max(problem.num_blocks, 1),
    )


def decode_params(
    problem, strides, splits, row_tiles, aligned, user, score_factor=1.0, out_scale=1.0
):
    """The ``DecodeParams`` of a KV-cache problem's split-KV launch: q's, k_cache's and
    v_cache's element ``strides`` (``(batch, head, row)`` each), the split count, the row
    tiles a KV head, whether the caches take 16-byte copies, the user's modifier
    arguments (as :func:`cuflash.gpu.kernel_params.forward_params`'), an FP8 cache's
    scalar descales (q's times k's, ``score_factor``, joins the softmax scale; v's is
    ``out_scale``); the call's addresses and lengths' value written at each launch
    (:data:`DECODE_ADDRESSES`)."""
    left, right = problem.window
    q_strides, k_strides, v_strides = strides
    return Params(
        "DecodeParams",
        DECODE_ADDRESSES,
        keep=(user,),
        user_args=getattr(user, "record", user),
        q_st=tuple(q_strides),
        k_st=tuple(k_strides),
        v_st=tuple(v_strides),
        num_heads=problem.num_heads,
        group=problem.group_size,
        q_len=problem.q_len,
        new_len=problem.new_len,
        win_left=left,
        win_right=right,
        num_splits=splits,
        row_tiles=row_tiles,
        aligned=int(aligned),
        scale_log2=problem.softmax_scale * LOG2E * score_factor,
        alibi_batch_stride=max(problem.alibi_batch_stride, 0),
        softcap_log2=problem.softcap * LOG2E,
        out_scale=out_scale,
        **_paging(problem),
    )


#: The members of ``KvcacheAppendParams`` a launch writes at each call, in order.
APPEND_ADDRESSES = (
    "k_new",
    "v_new",
    "k_cache",
    "v_cache",
    "seqlens",
    "block_table",
    "key_counts",
    "q",
    "q_rotated",
    "rotary_cos",
    "rotary_sin",
    "seqlen_value",
)


def append_params(problem, strides, rotary):
    """The ``KvcacheAppendParams`` of a KV-cache problem's append: k_new's, v_new's (None:
    no new rows), k_cache's, v_cache's and q's element ``strides``, the rotary scalars
    (``cuflash.rotary.append_arguments``); the call's addresses and lengths' value
    written at each launch (:data:`APPEND_ADDRESSES`)."""
    kn, vn, k, v, q = (() if x is None else tuple(x) for x in strides)
    rotary_dim, rotary_rows, interleaved, tables_in_t = rotary
    return Params(
        "KvcacheAppendParams",
        APPEND_ADDRESSES,
        kn_st=kn or (0, 0, 0),
        vn_st=vn or (0, 0, 0),
        k_st=k,
        v_st=v,
        q_st=q,
        new_len=problem.new_len,
        head_dim=problem.head_dim,
        head_dim_v=problem.head_dim_v,
        q_len=problem.q_len,
        group=problem.group_size,
        rotary_dim=rotary_dim,
        rotary_rows=rotary_rows,
        interleaved=interleaved,
        tables_in_t=tables_in_t,
        **_paging(problem),
    )


def combine_params(problem, rows, splits):
    """The ``KvcacheCombineParams`` of the merge of ``splits`` partial rows of ``rows``
    query rows; the call writes ``part_out``, ``part_lse``, ``out``, ``lse`` and
    ``sinks``."""
    return Params(
        "KvcacheCombineParams",
        ("part_out", "part_lse", "out", "lse", "sinks"),
        rows=rows,
        num_splits=splits,
        num_heads=problem.num_heads,
        q_len=problem.q_len,
    )
