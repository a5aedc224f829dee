"""docs/spatial.md's list of what runs on a part and what is refused, made from the op table
(ops.py), so that the list cannot drift from the code.

A test compares the document's section with :func:`section_lines`; after changing the table,
``python -m hpdl.torch.spatial.ops_table --write docs/spatial.md`` rewrites the section in place
(without ``--write`` it prints it).
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from hpdl.torch.spatial import ops
from hpdl.torch.spatial.ops import Kind

BEGIN = "<!-- the op table: made by `python -m hpdl.torch.spatial.ops_table --write docs/spatial.md` -->"
END = "<!-- end of the op table -->"

_RULES = {
    Kind.ELEMENTWISE: "exact: each output pixel from the same pixel of the inputs; another tensor beside the part "
                      "must be the same part of a map of the same size, or of size 1 in its last two dimensions; a part "
                      "of a map of length 1 along an image dimension the grid does not split broadcasts there "
                      "(`x * x.mean(3, keepdim=True)` on row bands)",
    Kind.RANDOM: "each band draws from its own stream (see Dropout and random numbers), never every band the "
                 "same numbers",
    Kind.RANDOM_CHANNELS: "one draw for the group: every band drops the same channels, as one process drops them "
                          "over the whole image (see Dropout and random numbers)",
    Kind.CONVERT: "exact: a copy in another type, device or memory layout; another tensor converted like the "
                  "part (`mean.type_as(x)`, `mean.to(x)`) is that tensor, converted",
    Kind.LIKE: "exact: the same part of a new map",
    Kind.ALONG: "exact along the batch or channel dimensions; refused along an image dimension (or with no "
                "dimension, where that means all of them; but `x.max()`, `x.min()`, `torch.aminmax(x)` and "
                "`x.prod()` are the whole image's); a scatter's index and source must be the same part as its input",
    Kind.CONCAT: "exact along the batch or channel dimensions, of parts of maps of the same size",
    Kind.RESHAPE: "exact where the image dimensions stay the last two, whole; merged into the last one "
                  "(`x.flatten(2)`, `x.view(n, c, -1)`), only to be summed, averaged or maximized over it",
    Kind.EXPAND: "exact where the image dimensions stay the last two, whole (a tensor of size 1 there may be "
                 "expanded to a part, or to lengths read from a part: `pooled.expand(b, c, h, w)`, a part)",
    Kind.PERMUTE: "exact where the image dimensions stay the last two, in order, or move together before the last "
                  "(channels last: see Channels-last blocks)",
    Kind.SHAPE: "the part's own lengths, which compare and compute as the whole image's (see Lengths)",
    Kind.METADATA: "what is the same on every part",
    Kind.PART_ATTRIBUTE: "the same part",
    Kind.NEW: "a part of a new map where the size ends in lengths read from a part; else what one process makes",
    Kind.FACTORY: "as the `new_*` methods",
}


def _base(spelled: str) -> str:
    """``Tensor.add_`` -> ``add``; ``x.shape`` -> ``.shape``; ``Tensor.__add__`` -> ``__add__``."""
    if spelled.startswith("x."):
        return "." + spelled[2:]
    name = spelled.split(".", 1)[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _by_kind() -> Dict[Kind, List[Tuple[str, ops.Op]]]:
    out: Dict[Kind, List[Tuple[str, ops.Op]]] = {}
    for func, op in ops.TABLE.items():
        out.setdefault(op.kind, []).append((ops.spelled(func), op))
    return out


def section_lines() -> List[str]:
    """The section's lines in Markdown, between its markers."""
    kinds = _by_kind()
    lines = [BEGIN, "", "**Layers with a spatial version** (each exact, forward and backward):", "",
             "| call | on a part |", "|---|---|"]
    for spelled, op in sorted(kinds[Kind.HANDLER]):
        lines.append(f"| `{spelled}` | {op.why} |")
    lines += ["", "**Everything else that runs on a part**, by rule (each name as `torch.X`, `Tensor.X`, the "
              "in-place `Tensor.X_` and `F.X`, where PyTorch has them):", "", "| rule | calls |", "|---|---|"]
    for kind, rule in _RULES.items():
        names = sorted({_base(spelled) for spelled, _ in kinds.get(kind, [])})
        if kind is Kind.ALONG:
            names = sorted({f"{_base(s)} ({op.dim})" if op.dim else _base(s) for s, op in kinds[kind]})
        lines.append(f"| {rule} | {', '.join(f'`{n}`' for n in names)} |")
    lines.append("| `x[...]`, `x[...] = v` | exact on the batch and channel dimensions; a slice of the image's rows "
                 "or columns (`x[..., a:b, :]`, also with a step: `x[..., 1::2, ::2]`) is a crop of the whole "
                 "image; an index or a mask there, or assigning to rows or columns, is refused |")
    lines += ["", "**Refused, with the reason** (anything not named on this page is refused too, naming the layer "
              "and the call):", "", "| reason | calls |", "|---|---|"]
    reasons: Dict[str, List[str]] = {}
    for spelled, op in kinds.get(Kind.REFUSED, []):
        reasons.setdefault(op.why, []).append(_base(spelled))
    for why, names in sorted(reasons.items()):
        lines.append(f"| {why} | {', '.join(f'`{n}`' for n in sorted(set(names)))} |")
    lines += ["", END]
    return lines


def document_section(text: str) -> List[str]:
    """The section's lines in ``text`` (docs/spatial.md), markers included; [] if none."""
    span = _table_lines(text.split("\n"))
    return text.split("\n")[span[0]:span[1]] if span else []


def replace_section(text: str) -> str:
    """``text`` with its section replaced by :func:`section_lines`.

    Raises:
        ValueError: when ``text`` has no section between the markers.
    """
    lines = text.split("\n")
    span = _table_lines(lines)
    if span is None:
        raise ValueError(f"no section between {BEGIN!r} and {END!r}")
    return "\n".join(lines[:span[0]] + section_lines() + lines[span[1]:])


def _table_lines(lines: List[str]) -> Optional[Tuple[int, int]]:
    """Where the generated table lies in ``lines``: (its BEGIN line, one past its END line), or None."""
    if BEGIN not in lines or END not in lines:
        return None
    return lines.index(BEGIN), lines.index(END) + 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpdl.torch.spatial.ops_table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="DOC", help="replace the section in this file instead of printing it")
    args = parser.parse_args(argv)
    if args.write is None:
        print("\n".join(section_lines()))
        return 0
    with open(args.write, encoding="utf-8") as f:
        text = f.read()
    try:
        new = replace_section(text)
    except ValueError as err:
        sys.stderr.write(f"{args.write}: {err}\n")
        return 2
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
