"""The command-line pieces of the benchmarks that time cuflash next to ``flex_attention``
(``python -m cuflash.bench_masks``, ``python -m cuflash.bench_modifiers``)."""

import json

from .environment import gpu_unavailable_reason, import_torch


def add_peer_options(parser):
    """The options of the benchmarks that time cuflash next to ``flex_attention``:
    ``--no-torch``, ``--time``, ``--json``."""
    parser.add_argument("--no-torch", action="store_true", help="cuflash only")
    parser.add_argument("--time", type=float, default=0.5, help="seconds a measurement")
    parser.add_argument("--json", default=None)


def no_gpu_to_measure():
    """True (printing why) when there is no GPU to time on."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"nothing to measure: {reason}")
    return reason is not None


def flex_peer_torch(enabled):
    """torch for a ``flex_attention`` peer, or None (printing why it is left out)."""
    torch, note = import_torch(enabled)
    if torch is None:
        print(f"flex_attention left out: {note}")
    return torch


def print_report(title, table_text, records, json_path=None):
    """Print a benchmark's title and table; write its records to ``json_path`` if given."""
    print(title)
    print(table_text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
