"""What the loops of compiled GPU kernels do, by instruction kind (issue 20).

    python -m benchmarks.ptx_loops DIR [--kernel fp8_matmul] [--top 3] [--save OUT --most 2]

Reads every `.ptx` file under DIR, e.g. the dump of `XLA_FLAGS=--xla_dump_to=DIR`, which holds
the PTX of a module's kernels with the Pallas Triton calls among them. For each kernel
(`.entry`) whose name contains `--kernel`, it counts the kernel's instructions by kind, then
those of its largest loops (a label and a branch back to it).

The kinds:
- global loads (`ld.global`);
- copies to shared memory issued ahead by a software pipeline (`cp.async`; `cp.async.bulk`
  is TMA), and their waits;
- tensor-core MMAs (`wgmma`, `mma`);
- barriers, atomics and stores.

`--save` writes the first `--most` matching kernels' PTX to OUT, one file each, to be read.

The question it answers: the FP8 GEMM at 32 rows reads its weights at 1.4 (down) and 2.1
(gate/up) TB/s on an H100, where the bf16 FFN reads at 2.7 (RESULTS.md). Does its K loop
wait on plain global loads each iteration (the per-group scales), or does the pipeline issue
every load ahead?
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
from pathlib import Path

# Instruction kinds in the order printed: (name, a regular expression its opcode matches);
# the first match counts (so the waits before the copies they wait on, the wgmma wait before
# the MMAs; wgmma's fences and commits count as none).
KINDS = (
    ("async wait", r"cp\.async(\.bulk)?\.(wait|commit)|mbarrier"),
    ("tma", r"cp\.async\.bulk"),
    ("cp.async", r"cp\.async"),
    ("ld.global", r"ld\.(\w+\.)*global"),
    ("ld.shared", r"ld\.(\w+\.)*shared|ldmatrix"),
    ("wgmma wait", r"wgmma\.wait_group"),
    ("wgmma", r"wgmma\.mma_async"),
    ("mma", r"mma\."),
    ("st.global", r"(st|red)\.(\w+\.)*global"),
    ("st.shared", r"st\.(\w+\.)*shared|stmatrix"),
    ("atom", r"atom\."),
    ("bar", r"bar\.|barrier\."),
)
_KINDS = tuple((name, re.compile(pattern)) for name, pattern in KINDS)

_ENTRY = re.compile(r"^\s*\.(?:visible\s+)?\.?entry\s+([\w$.]+)\s*\(", re.M)
_LABEL = re.compile(r"^\s*([\w$]+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+([\w$]+)\s*;")


@dataclasses.dataclass
class Loop:
    first: int   # line of its label, within the kernel (0-based; printed 1-based)
    last: int    # line of the branch back
    counts: collections.Counter


def kind(line: str) -> str | None:
    """The kind of one PTX instruction line (None: another instruction or not one)."""
    parts = line.split()
    if parts and parts[0].startswith("@"):  # a predicate: "@%p1 ld.global..." or "@!%p1 ..."
        parts = parts[1:]
    if not parts:
        return None
    for name, pattern in _KINDS:
        if pattern.match(parts[0]):
            return name
    return None


def count(lines: list[str]) -> collections.Counter:
    c = collections.Counter(k for k in map(kind, lines) if k)
    c["instructions"] = sum(1 for s in lines if s.strip().endswith(";"))
    return c


def kernels(text: str) -> dict[str, list[str]]:
    """Each `.entry` of a PTX file: its name and lines, up to the next entry."""
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(text)]
    ends = [s for s, _ in starts[1:]] + [len(text)]
    return {name: text[s:e].splitlines() for (s, name), e in zip(starts, ends)}


def loops(lines: list[str]) -> list[Loop]:
    """Every loop of a kernel (nested ones too), largest first."""
    labels = {}
    for i, s in enumerate(lines):
        m = _LABEL.match(s)
        if m:
            labels[m.group(1)] = i
    found = {}
    for j, s in enumerate(lines):
        m = _BRANCH.search(s)
        if m and labels.get(m.group(1), j + 1) <= j:  # a branch back: the loop's end
            i = labels[m.group(1)]
            found[i] = max(found.get(i, j), j)
    out = [Loop(i, j, count(lines[i:j + 1])) for i, j in found.items()]
    return sorted(out, key=lambda lp: lp.last - lp.first, reverse=True)


def matching(directory: Path, kernel: str):
    """(file, kernel name, its lines) of each kernel whose name contains `kernel`."""
    for path in sorted(directory.rglob("*.ptx")):
        for name, lines in kernels(path.read_text(errors="replace")).items():
            if kernel in name:
                yield path, name, lines


def report(directory: Path, kernel: str, top: int) -> list[str]:
    out = []
    for path, name, lines in matching(directory, kernel):
        out.append(f"{path.name} {name}: {fmt(count(lines))}")
        for lp in loops(lines)[:top]:
            out.append(f"  loop lines {lp.first + 1}-{lp.last + 1}: {fmt(lp.counts)}")
    return out or [f"no kernel named *{kernel}* in the .ptx files under {directory}"]


def save(directory: Path, kernel: str, out: Path, most: int) -> list[Path]:
    """The PTX of the first `most` kernels of distinct names matching `kernel`, a file each."""
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for _, name, lines in matching(directory, kernel):
        if len(written) == most:
            break
        if name not in written:
            written[name] = out / f"{name[:80]}.ptx"
            written[name].write_text("\n".join(lines) + "\n")
    return list(written.values())


def fmt(c: collections.Counter) -> str:
    return ", ".join(f"{k} {c[k]}" for k in ["instructions"] + [n for n, _ in KINDS] if c[k])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("directory", type=Path)
    ap.add_argument("--kernel", default="fp8_matmul", help="a part of the kernels' names")
    ap.add_argument("--top", type=int, default=3, help="loops listed per kernel")
    ap.add_argument("--save", type=Path, help="a directory for the matching kernels' PTX")
    ap.add_argument("--most", type=int, default=2, help="with --save: kernels written")
    args = ap.parse_args()
    if not args.directory.is_dir():
        raise SystemExit(f"{args.directory} is not a directory")
    print("\n".join(report(args.directory, args.kernel, args.top)))
    if args.save:
        for path in save(args.directory, args.kernel, args.save, args.most):
            print(f"-> {path}")


if __name__ == "__main__":
    main()
