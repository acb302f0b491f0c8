"""The performance page's kernel table: each forward and backward kernel of the registry
(``cuflash.gpu.registry.KERNELS``) and what it serves, as Markdown (conf.py writes it
into ``_generated/kernels.md`` at each docs build)."""

from cuflash.gpu import registry


def coverage_table():
    """Markdown: each forward and backward kernel and what it serves."""
    rows = [
        "| kernel | direction | instruction | precision | GPUs | head_dim | score modifiers |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in registry.KERNELS:
        if spec.direction == "helper":
            continue
        gpus = "sm_90 (H100/H200)" if spec.archs == registry.HOPPER else "sm_80 and newer"
        dims = (
            ", ".join(map(str, spec.head_dims))
            if spec.exact_head_dims
            else f"{spec.head_dims[0]}-{spec.head_dims[1]}"
        )
        if spec.short_rows_kernel is not None:
            kernel, largest, keys = spec.short_rows_kernel
            dims += (
                f" (plain calls up to {largest} whose rows see fewer than {keys} keys"
                f" on average: `{kernel}`)"
            )
        precision = spec.precision
        if spec.fp8_head_dims is not None:
            low, high = spec.fp8_head_dims
            precision += f"; FP8 (e4m3) at multiples of 16 from {low} to {high}"
        rows.append(
            f"| `{spec.name}` | {spec.direction} | {spec.instruction} | "
            f"{precision} | {gpus} | {dims} | {_modifiers_served(spec)} |"
        )
    return "\n".join(rows)


def _modifiers_served(spec):
    if spec.modifiers:
        return "yes"
    return "a user's mask alone" if spec.mask_modifiers else "no"
