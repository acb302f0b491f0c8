"""Registers, spills and SASS of compiled kernel roles, one source tree against another.

A change meant to leave the generated code alone (the kernels' parameter lists, say) is
held to it here without a GPU: each tree's kernels are compiled through NVRTC for
sm_80 and sm_90a (the compile tests' variants, ``tests/test_compile.py``'s
``class_ends``, or the ``--variants`` given), and each role's registers, spill bytes
and stack frame are compared, and its SASS with the constant-bank operands
(``c[0x0][...]``: the parameters' offsets) blanked.

    python scripts/compare_kernel_resources.py --before ../main --after . [--jobs 2]
    python scripts/compare_kernel_resources.py --report TREE OUT.json   # one tree

``--report`` runs under the tree's own ``cuflash`` (a subprocess with PYTHONPATH set),
so the trees need not share a checkout. ``--roles`` (a regular expression) narrows
the roles compared; ``--before`` may be given twice (e.g. a second reference tree for
some roles: the first that holds a role is the reference of that role, unless
``--prefer`` names a regular expression of roles that take the second first).
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor


def _variants(spec):
    """``spec``: "bfloat16:64:90,float32:128:80,..." or "" for the compile tests' set."""
    import numpy as np

    from cuflash.gpu import kernel_build

    if not spec:
        sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
        from test_compile import JOBS

        return [(v, arch) for v, arch in JOBS]
    from cuflash.core.dtypes import BFLOAT16

    jobs = []
    for item in spec.split(","):
        dtype, head_dim, sm = item.split(":")
        dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
        arch = "sm_90a" if sm == "90" else "sm_80"
        jobs.append((kernel_build.Variant(dt, int(head_dim), int(sm)), arch))
    return jobs


def _sass_digests(report):
    """Per role: a digest of its SASS, constant-bank operands and addresses blanked."""
    from cuflash.gpu import kernel_build

    tool = kernel_build.find_cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v.cubin")
        with open(path, "wb") as f:
            f.write(report.cubin)
        env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(tool), os.environ["PATH"]]))
        text = subprocess.run(
            [tool, "-sass", path], capture_output=True, text=True, env=env, check=True
        ).stdout
    by_name, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            current = by_name[m.group(1)] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m and current is not None:
            current.append(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][*]", m.group(1)))
    return {
        role: hashlib.sha1("\n".join(by_name[name]).encode()).hexdigest()[:12]
        for role, name in report.lowered_names.items()
    }


def _compile(job):
    from cuflash.gpu import kernel_build

    variant, arch, roles = job
    report = kernel_build.compile_offline(variant, arch, roles=roles)
    digests = _sass_digests(report)
    return {
        f"{variant.dtype}-d{variant.head_dim}-{arch}:{role}": dict(info, sass=digests[role])
        for role, info in report.kernels().items()
    }


def report(out, variants, role_pattern, jobs):
    work = []
    for variant, arch in _variants(variants):
        roles = [r for r in variant.kernel_names() if re.search(role_pattern, r)]
        if roles:
            work.append((variant, arch, roles))
    found = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for part in pool.map(_compile, work):
            found.update(part)
    with open(out, "w") as f:
        json.dump(found, f, indent=1, sort_keys=True)


def _run_report(tree, variants, roles, jobs):
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--report",
            os.path.abspath(tree),
            out,
            "--variants",
            variants,
            "--roles",
            roles,
            "--jobs",
            str(jobs),
        ],
        cwd=os.path.abspath(tree),
        env=env,
        check=True,
    )
    with open(out) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", action="append", default=[])
    parser.add_argument("--after")
    parser.add_argument("--report", nargs=2, metavar=("TREE", "OUT"))
    parser.add_argument("--variants", default="")
    parser.add_argument("--roles", default="")
    parser.add_argument("--prefer", default=None)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", help="also write the comparison rows here")
    args = parser.parse_args()
    if args.report:
        report(args.report[1], args.variants, args.roles, args.jobs)
        return
    befores = [_run_report(t, args.variants, args.roles, args.jobs) for t in args.before]
    after = _run_report(args.after, args.variants, args.roles, args.jobs)
    rows, changed = [], 0
    print("| role | before regs | after regs | spills before/after | SASS |")
    print("|---|---|---|---|---|")
    for key in sorted(after):
        order = list(befores)
        if args.prefer and len(order) > 1 and re.search(args.prefer, key):
            order = order[1:] + order[:1]
        ref = next((b[key] for b in order if key in b), None)
        a = after[key]
        spills = a["spill_stores"] + a["spill_loads"] + a["stack"]
        if ref is None:
            line = f"| {key} | - | {a['registers']} | -/{spills} | new |"
        else:
            ref_spills = ref["spill_stores"] + ref["spill_loads"] + ref["stack"]
            same = ref["sass"] == a["sass"]
            changed += ref["registers"] != a["registers"] or ref_spills != spills
            line = (
                f"| {key} | {ref['registers']} | {a['registers']} | {ref_spills}/{spills} | "
                f"{'same' if same else 'differs'} |"
            )
        rows.append(line)
        print(line)
    print(f"\n{len(after)} roles, {changed} with other registers or spills")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": befores, "after": after}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
