"""Draw the visible-key pictures of the Semantics page from the library's own rule.

Every picture comes from :func:`cuflash.core.masking.visible_keys`, fed with the
window bounds that :func:`cuflash.core.problem.forward_problem` derives from the
user-facing arguments (``causal``, ``window_size``, ``kv_seq_len``), so the
pictures show exactly what the kernels compute. As a guard, each pattern is
also read back from a real forward pass on the CPU path (uniform scores and
one-hot values make ``out[i, j] > 0`` exactly when query ``i`` sees key
``j``) and the script stops if the two disagree.

``docs/conf.py`` runs this at every build; it can also be run by hand::

    python docs/make_mask_figures.py [OUTPUT_DIR]

The PNGs go to ``docs/_static/masks/`` by default.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cuflash  # noqa: E402
from cuflash.core.masking import visible_keys  # noqa: E402
from cuflash.core.problem import forward_problem  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "_static" / "masks"
HIDDEN, VISIBLE, NOT_READ = 0, 1, 2
COLORS = ListedColormap(["#eef0f3", "#3b6fb6", "#b9bec7"])
NO_KEY = "#c0392b"
DPI = 110
CELL = 0.3  # inches per cell
FONT = 10  # points; the pages show the pictures a little smaller than drawn


def _problem(
    q_len,
    kv_capacity,
    causal=False,
    window_size=0,
    kv_seq_len=None,
    num_heads=1,
    num_kv_heads=1,
    head_dim=16,
):
    """Validate the arguments the way a real call does; return the problem."""
    q = np.zeros((1, num_heads, q_len, head_dim), np.float32)
    kv = np.zeros((1, num_kv_heads, kv_capacity, head_dim), np.float32)
    config = cuflash.AttentionConfig(
        num_heads, num_kv_heads, head_dim, causal, window_size, kv_seq_len
    )
    return forward_problem(q, kv, kv, config)


def pattern(q_len, kv_capacity, causal=False, window_size=0, kv_seq_len=None):
    """``[S_q, S_k]`` codes: HIDDEN, VISIBLE, or NOT_READ (at or past kv_seq_len)."""
    problem = _problem(q_len, kv_capacity, causal, window_size, kv_seq_len)
    visible = visible_keys(
        np.arange(q_len), np.arange(kv_capacity), problem.q_len, problem.kv_len, *problem.window
    )
    _check_against_forward(visible, q_len, kv_capacity, causal, window_size, kv_seq_len)
    codes = np.where(visible, VISIBLE, HIDDEN)
    codes[:, problem.kv_len :] = NOT_READ
    return codes, problem


def _check_against_forward(visible, q_len, kv_capacity, causal, window_size, kv_seq_len):
    """Read the pattern back from a CPU forward pass and compare."""
    head_dim = 8 * -(-kv_capacity // 8)
    q = np.zeros((1, 1, q_len, head_dim), np.float32)
    k = np.zeros((1, 1, kv_capacity, head_dim), np.float32)
    v = np.zeros((1, 1, kv_capacity, head_dim), np.float32)
    v[0, 0, np.arange(kv_capacity), np.arange(kv_capacity)] = 1.0  # one-hot values
    out, _ = cuflash.flash_attention_fwd(q, k, v, 1, 1, head_dim, causal, window_size, kv_seq_len)
    seen = out[0, 0, :, :kv_capacity] > 0
    if not np.array_equal(seen, visible):
        raise AssertionError(
            f"visible_keys and the CPU forward disagree for S_q={q_len}, S_k={kv_capacity}, "
            f"causal={causal}, window_size={window_size}, kv_seq_len={kv_seq_len}"
        )


def draw_pattern(ax, codes, problem, title):
    """One grid: rows are queries (labelled with their position p), columns keys."""
    q_len, kv_capacity = codes.shape
    ax.imshow(codes, cmap=COLORS, vmin=0, vmax=2, aspect="equal", interpolation="nearest")
    ax.set_xticks(np.arange(kv_capacity))
    ax.set_xticklabels([str(j) for j in range(kv_capacity)], fontsize=FONT - 1)
    ax.set_yticks(np.arange(q_len))
    offset = problem.kv_len - problem.q_len
    ax.set_yticklabels(
        [f"{i} ({i + offset})" for i in range(q_len)], fontsize=FONT - 1, family="monospace"
    )
    ax.set_ylabel("query i (position p)", fontsize=FONT - 1)
    ax.set_xticks(np.arange(-0.5, kv_capacity), minor=True)
    ax.set_yticks(np.arange(-0.5, q_len), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.2)
    ax.tick_params(which="both", length=0)
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    ax.set_xlabel("key j", fontsize=FONT - 1)
    for i in range(q_len):
        if not (codes[i] == VISIBLE).any():
            ax.get_yticklabels()[i].set_color(NO_KEY)
            ax.text(
                kv_capacity - 0.5 + 0.3,
                i,
                "no key",
                color=NO_KEY,
                fontsize=FONT - 1,
                va="center",
                ha="left",
            )
    ax.set_title(title, fontsize=FONT, pad=6)
    for side in ax.spines.values():
        side.set_visible(False)


def _legend(fig, with_not_read=False, with_no_key=False):
    from matplotlib.patches import Patch

    handles = [
        Patch(color=COLORS(VISIBLE), label="visible"),
        Patch(color=COLORS(HIDDEN), label="masked"),
    ]
    if with_not_read:
        handles.append(Patch(color=COLORS(NOT_READ), label="not read (>= kv_seq_len)"))
    if with_no_key:
        handles.append(Patch(color=NO_KEY, label="row sees no key: zeros, lse = -inf"))
    fig.legend(
        handles=handles, loc="lower center", ncol=len(handles), fontsize=FONT - 1, frameon=False
    )


def figure_of_panels(panels, path, with_not_read=False, show_bounds=False):
    """Panels side by side: ``[(title, kwargs-for-pattern), ...]``.

    With ``show_bounds`` each title gets the ``(left, right)`` bounds that the
    validation derived (``-1`` = unbounded).
    """
    drawn = []
    for title, kwargs in panels:
        codes, problem = pattern(**kwargs)
        if show_bounds:
            title += "\n(left, right) = ({}, {})".format(*problem.window)
        drawn.append((title, codes, problem))
    widths = [codes.shape[1] + 5 for _, codes, _ in drawn]  # cells + room for labels
    height = max(codes.shape[0] for _, codes, _ in drawn)
    fig, axes = plt.subplots(
        1,
        len(drawn),
        figsize=(CELL * sum(widths) + 0.6, CELL * height + 2.0),
        gridspec_kw={"width_ratios": widths},
    )
    axes = np.atleast_1d(axes)
    for ax, (title, codes, problem) in zip(axes, drawn):
        draw_pattern(ax, codes, problem, title)
    no_key = any(
        not (codes[i] == VISIBLE).any() for _, codes, _ in drawn for i in range(codes.shape[0])
    )
    _legend(fig, with_not_read, no_key)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def figure_gqa(path, num_heads=8, num_kv_heads=2):
    """Which KV head each query head reads, from the validated problem's group size."""
    problem = _problem(4, 4, num_heads=num_heads, num_kv_heads=num_kv_heads)
    group = problem.group_size
    reads = [h // group for h in range(num_heads)]
    fig, ax = plt.subplots(figsize=(0.75 * num_heads + 1.0, 2.3))
    palette = plt.get_cmap("tab10")
    kv_x = [(g + 0.5) * num_heads / num_kv_heads - 0.5 for g in range(num_kv_heads)]
    for h, g in enumerate(reads):
        ax.plot([h, kv_x[g]], [1.0, 0.0], color=palette(g), linewidth=1.5, zorder=1)
        ax.add_patch(
            FancyBboxPatch(
                (h - 0.32, 1.0 - 0.18),
                0.64,
                0.36,
                boxstyle="round,pad=0.02",
                color=palette(g),
                zorder=2,
            )
        )
        ax.text(h, 1.0, f"q{h}", ha="center", va="center", color="white", fontsize=FONT, zorder=3)
    for g, x in enumerate(kv_x):
        width = group * 0.75
        ax.add_patch(
            FancyBboxPatch(
                (x - width / 2, -0.18),
                width,
                0.36,
                boxstyle="round,pad=0.02",
                color=palette(g),
                zorder=2,
            )
        )
        ax.text(
            x, 0.0, f"k{g}, v{g}", ha="center", va="center", color="white", fontsize=FONT, zorder=3
        )
    ax.text(-0.6, 1.0, "query heads", ha="right", va="center", fontsize=FONT)
    ax.text(-0.6, 0.0, "KV heads", ha="right", va="center", fontsize=FONT)
    ax.set_xlim(-2.9, num_heads - 0.3)
    ax.set_ylim(-0.45, 1.45)
    ax.set_title(
        f"num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
        f"query head h reads KV head h // {group}",
        fontsize=FONT + 1,
    )
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def main(out_dir=DEFAULT_OUT):
    """Write every picture into ``out_dir``; return the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def target(name):
        written.append(out_dir / name)
        return written[-1]

    figure_of_panels(
        [
            ("causal, S_q=3 < S_k=7", dict(q_len=3, kv_capacity=7, causal=True)),
            ("causal, S_q = S_k = 6", dict(q_len=6, kv_capacity=6, causal=True)),
            ("causal, S_q=7 > S_k=4", dict(q_len=7, kv_capacity=4, causal=True)),
        ],
        target("causal.png"),
    )
    figure_of_panels(
        [
            ("causal, window_size=3", dict(q_len=7, kv_capacity=7, causal=True, window_size=3)),
            ("window_size=3", dict(q_len=7, kv_capacity=7, window_size=3)),
            ("window_size=(2, 1)", dict(q_len=7, kv_capacity=7, window_size=(2, 1))),
        ],
        target("windows.png"),
        show_bounds=True,
    )
    figure_of_panels(
        [
            ("decode: S_q=1, kv_seq_len=6 of 10", dict(q_len=1, kv_capacity=10, kv_seq_len=6)),
            (
                "causal chunk: S_q=3, kv_seq_len=7 of 10",
                dict(q_len=3, kv_capacity=10, causal=True, kv_seq_len=7),
            ),
        ],
        target("kv_seq_len.png"),
        with_not_read=True,
    )
    figure_gqa(target("gqa.png"), num_heads=8, num_kv_heads=2)
    figure_gqa(target("mqa.png"), num_heads=4, num_kv_heads=1)
    return written


if __name__ == "__main__":
    for p in main(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT):
        print(p)
