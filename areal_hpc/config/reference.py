"""The config reference page (docs/config.md), generated from the config dataclasses (areal_hpc/config/__init__.py,
config/task.py, config/cluster.py) and their comments."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import sys
import tempfile
import tokenize
from pathlib import Path

from areal_hpc import config
from areal_hpc.config import cluster as config_cluster
from areal_hpc.config import task as config_task

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m areal_hpc.config.reference --write"


def describe(source: str) -> dict[str, tuple[str, dict[str, tuple[str, str]]]]:
    """Per class: its docstring and, per field, (type as written, description).

    A field's description is the comment lines right above it, then the comment on its own line; ruff
    format moves a comment continued below a field to the next field's indentation, so below never counts.
    """
    comments = {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = {}
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above, n = [], node.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            inline = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            fields[node.target.id] = (ast.unparse(node.annotation), " ".join(above + inline))
        out[cls.name] = (ast.get_docstring(cls) or "", fields)
    return out


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (a `<name>` would be read as an HTML tag and vanish)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _default(value: object) -> str:
    if value == config.MISSING:
        return "required"
    if isinstance(value, str) and value:  # as it is written in YAML, no quotes
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def _table(prefix: str, cls: type, names: list[str], docs: dict) -> list[str]:
    """One Markdown table: each of `names` (fields of `cls`) with its type, default and description."""
    doc, fields = docs[cls.__name__]
    obj = cls()
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name in names:
        type_, text = fields[name]
        if not text:
            raise ValueError(f"{prefix}{name} has no comment in its config dataclass: write one (what, allowed values)")
        rows.append(f"| `{prefix}{name}` | `{_cell(type_)}` | {_cell(_default(getattr(obj, name)))} | {_cell(text)} |")
    return ([doc, ""] if doc else []) + rows


def page() -> str:
    """The whole page: the top-level keys, then one section per part of the config."""
    docs = {
        k: v for m in (config, config_cluster, config_task) for k, v in describe(Path(m.__file__).read_text()).items()
    }
    fields = dataclasses.fields(config.Config)
    sections = [f for f in fields if dataclasses.is_dataclass(f.default_factory)]
    top = [f.name for f in fields if f not in sections]
    out = [
        "# Config reference",
        "",
        "Generated from `areal_hpc/config/__init__.py`, `config/task.py` and `config/cluster.py` (their comments) by",
        f"`{COMMAND}`; edit those, not this page.",
        "A key is set in its section of a YAML file (`slurm:` then `signal_s: 300`) or as a dotted override",
        "after the file (`areal-hpc run jobs/demo.yaml slurm.signal_s=300`); `areal-hpc config FILE` prints the",
        "resolved config, and a bad value stops with one line naming the key and what is allowed. A file with",
        "`base: other.yaml` (relative to it) starts from that file and sets only what it changes.",
        "",
        "Sections: " + ", ".join(f"[{s.name}](#{s.name})" for s in sections) + ".",
        "",
        "## Top level",
        "",
        *_table("", config.Config, top, docs),
    ]
    for s in sections:
        cls = s.default_factory
        names = [f.name for f in dataclasses.fields(cls)]
        out += ["", f"## {s.name}", "", *_table(f"{s.name}.", cls, names, docs)]
    return "\n".join(out) + "\n"


def write(path: Path = PAGE) -> None:
    """Write the page atomically: a reader (or a test) never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, 0o644)  # mkstemp makes it private; the page is for everyone
    with os.fdopen(fd, "w") as f:
        f.write(page())
    os.replace(tmp, path)


def main(argv: list[str]) -> None:
    if argv == ["--write"]:
        write()
    elif not argv:
        sys.stdout.write(page())
    else:
        sys.exit(f"usage: python -m areal_hpc.config.reference [--write]  (--write: into {PAGE})")


if __name__ == "__main__":
    main(sys.argv[1:])
