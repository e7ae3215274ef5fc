"""Checks over the package source: the run directory's layout lives in one module, the protocol's text
matches what is sent, imports keep docs/architecture.md's layers, and that page's message table points at the code."""

from __future__ import annotations

import ast
import contextlib
import inspect
import re
from pathlib import Path

from areal_hpc import rundir
from areal_hpc.count_schema import GROUP_COUNTS
from areal_hpc.rundir import SHARD_SUFFIX, TMP_SUFFIX, WEIGHTS_FILE, RunDir, SweepDir, rng_file, shard_name
from areal_hpc.runtime.comm import protocol
from areal_hpc.runtime.comm.protocol import FIELDS, GROUP_FIELDS, ProtocolError, Tag, check_fields

PACKAGE = Path(__file__).resolve().parents[1] / "areal_hpc"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


SAMPLE_ARGS = {"version": 3, "rank": 3, "role": "trainer", "job_id": "77"}


def _layout_names() -> set[str]:
    """Every file and folder name RunDir and SweepDir hand out, relative to their roots: their properties, and
    their methods that name a path, called with sample arguments (a version, a rank, a role, a job id); and the
    module's names of files inside a version's folders (a checkpoint's meta.json, a shard's name)."""
    run, sweep = RunDir("/r"), SweepDir("/s")
    names = set()
    for obj, root in ((run, run.root), (sweep, sweep.root)):
        for attr in dir(type(obj)):
            member = getattr(type(obj), attr)
            if attr.startswith("_"):
                continue
            if isinstance(member, property):
                values = getattr(obj, attr)
            elif callable(member) and set(inspect.signature(member).parameters) - {"self"} <= set(SAMPLE_ARGS):
                params = set(inspect.signature(member).parameters) - {"self"}
                values = getattr(obj, attr)(**{k: SAMPLE_ARGS[k] for k in params})
            else:
                continue
            for p in values if isinstance(values, (tuple, list)) else [values]:
                if isinstance(p, (str, Path)) and Path(p).is_relative_to(root):
                    names.update(Path(p).relative_to(root).parts)
    names.update({shard_name(3, 17), rng_file(3)})
    names.update(v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and not k.endswith("_SUFFIX"))
    return names - {"%j"}


def _template(node: ast.AST) -> str | None:
    """A string constant or f-string as a regex of the names it can spell: `*` and each {...} match anything."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts = [node.value]
    elif isinstance(node, ast.JoinedStr):
        parts = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    else:
        return None
    return "".join(".*" if p is None else ".*".join(re.escape(q) for q in p.split("*")) for p in parts)


def _spells(template: str, literal: str, names: set[str], suffixes: set[str]) -> list[str]:
    """The run-dir names a string spells: one whole, a piece between slashes, a pattern that builds one from
    more than an extension of its own (`rank*.csv`, not `*.json`), a regex that parses one, or a string holding a
    run-dir suffix (`.h5`, `.tmp`)."""
    hits = set(re.split(r"[/\\]", literal)) & names if "*" not in literal else set()
    hits.update(s for s in suffixes if s in literal)
    if re.search(r"[\\^$]", literal) and len(re.sub(r"[^A-Za-z]", "", re.sub(r"\\.", "", literal))) >= 2:
        with contextlib.suppress(re.error):  # a regex that parses a name (`^v(\d{8,})\.json$`)
            hits.update(n for n in names if re.fullmatch(literal, n))
    for piece in template.split("/"):
        own = re.sub(r"\\(.)", r"\1", piece.replace(".*", ""))
        stem = re.sub(r"\.[A-Za-z0-9]+$", "", own)  # what the piece spells beside an extension (`*.json`: none)
        open_end = piece.endswith(".*") and not own.endswith("-")  # `summary.{key}` is no name; `discarded-{time}` is
        if len(re.sub(r"[^A-Za-z0-9]", "", stem)) >= 2 and not open_end:
            hits.update(n for n in names if re.fullmatch(piece, n))
    return sorted(hits)


# Words that are also run-dir names but mean something else where they stand: submitit's cluster kind and
# who submitted a job (a value in slurm/job.json).
NOT_PATHS = {
    ("launch/submit.py", "slurm", "cluster"),
    ("launch/submit.py", "submitit", "submitted_by"),
    ("launch/resume.py", "submitit", None),  # how a run was submitted (job.json's submitted_by), not a folder
    ("cli/slurm.py", "submitit", "flag_value"),
    ("trackers.py", "tensorboard", None),  # logging.trackers' names, defined once there
    ("trackers.py", "wandb", None),
    ("config/__init__.py", "tensorboard", None),  # the deprecated config key logging.tensorboard
    ("model/export.py", ".h5", None),  # a Keras weights file a model folder may hold (export refuses to copy it)
}


def _literal(node: ast.AST) -> str:
    """The characters a string constant or f-string spells itself ({...} left out)."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(v.value for v in node.values if isinstance(v, ast.Constant))


def _meaning(tree: ast.AST) -> dict[int, str]:
    """For string constants used as a keyword argument or a dict value: that keyword or key."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant):
            out[id(node.value)] = node.arg
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                    out[id(v)] = k.value
    return out


def test_no_run_dir_name_is_spelt_outside_the_rundir_module():
    names = _layout_names()
    suffixes = {SHARD_SUFFIX, TMP_SUFFIX}
    assert {WEIGHTS_FILE, "meta.json", "g003-00000017.h5", "v00000003.json", "error-rank003.txt"} <= names
    assert {"rollouts", "ledger", "checkpoints", "STOP", "config.yaml", "summary.json", "logs", "slurm"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "rundir" / "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        meaning = _meaning(tree)
        inside_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if (rel, node.value if isinstance(node, ast.Constant) else None, meaning.get(id(node))) in NOT_PATHS:
                continue
            template = _template(node)
            if template is None or id(node) in docstrings or id(node) in inside_fstrings:
                continue
            literal = _literal(node)
            for hit in _spells(template, literal, names, suffixes):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {hit!r}")
    assert not found, "run-dir names outside areal_hpc/rundir/__init__.py:\n" + "\n".join(found)


def _documented_fields() -> dict[str, list[str]]:
    """The protocol docstring's table: each message name with the quoted keys of its body."""
    doc = protocol.__doc__
    table = doc.split("`FIELDS`")[0]
    out: dict[str, list[str]] = {}
    current = None
    for line in table.splitlines():
        m = re.match(r"^  ([A-Z_]+)\s+(\{.*)$", line)
        if m and m.group(1) in Tag.__members__:
            current = m.group(1)
            out[current] = []
            line = m.group(2)
        elif not line.startswith("   "):
            current = None
        if current is not None:
            braces = line.split("}")[0] if current != "GROUPS_DONE" else line
            out[current] += re.findall(r'"([a-z_]+)"', braces)
    return out


def test_the_protocol_text_names_exactly_the_fields_sent():
    documented = _documented_fields()
    assert set(documented) == {t.name for t in Tag}, "every message is documented once"
    for tag, keys in FIELDS.items():
        doc = documented[tag.name]
        if tag == Tag.GROUPS_DONE:
            assert set(doc) == set(keys) | set(GROUP_FIELDS) - set(GROUP_COUNTS)  # the counts: by the schema's name
        else:
            assert set(doc) == set(keys), f"{tag.name}: documented {doc}, sent {keys}"


def test_a_message_with_other_fields_is_refused_before_it_is_sent():
    check_fields(Tag.WANT, {"k": 2})
    for tag, body in (
        (Tag.WANT, {"k": 2, "extra": 1}),
        (Tag.BYE, {}),
        (Tag.GROUPS_DONE, {"shard": "g", "groups": [{"indices": [0]}]}),
    ):
        try:
            check_fields(tag, body)
        except ProtocolError as err:
            assert tag.name in str(err)
        else:
            raise AssertionError(f"{tag.name} {body} was accepted")


def test_an_idle_rank_backs_off_between_polls_and_wakes_fast_again_after_work():
    import time

    b = protocol.Backoff(0.002, 0.01)
    naps = []
    for _ in range(5):
        naps.append(b.nap)
        t = time.perf_counter()
        b.sleep()
        assert time.perf_counter() - t >= naps[-1] * 0.9
    assert naps == [0.002, 0.004, 0.008, 0.01, 0.01]  # 5x fewer wake-ups than 2 ms polling once idle
    b.reset()
    assert b.nap == 0.002


def _section(title: str) -> list[str]:
    """The lines of docs/architecture.md's section whose `## ` heading starts with `title`."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"## {title}")), None)
    assert start is not None, f"{ARCHITECTURE.name} has no section '## {title}'"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name under areal_hpc; the package itself is ""."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """What each module imports of the package, at load time or inside functions: `import areal_hpc.x.y` is the
    longest module of x.y, `from areal_hpc.x import y` is x.y when that is a module, else x."""
    modules = _modules()

    def module_of(dotted: str) -> str:
        name = dotted.removeprefix("areal_hpc").removeprefix(".")
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(module_of(a.name) for a in node.names if a.name.split(".")[0] == "areal_hpc")
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: a relative import (the package imports absolutely)"
                if (node.module or "").split(".")[0] == "areal_hpc":
                    base = module_of(node.module)
                    named = (f"{base}.{a.name}".lstrip(".") for a in node.names)
                    deps.update(n if n in modules else base for n in named)
        graph[name] = deps - {name}
    return graph


def _layers() -> dict[str, int]:
    """docs/architecture.md's Layers section: each unit (a dotted module prefix under areal_hpc, `areal_hpc` for
    the package's own __init__) with the number of its layer, bottom 0."""
    layers, current = {}, None
    for line in _section("Layers"):
        if m := re.match(r"^(\d+)\. ", line):
            current = int(m.group(1))
        elif not line.startswith(" "):
            current = None
        if current is not None:
            for unit in re.findall(r"`([a-z_][a-z0-9_.]*)`", line):
                layers["" if unit == "areal_hpc" else unit] = current
    return layers


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of the longest unit that is the module or a package above it."""
    units = [u for u in layers if module == u or module.startswith(f"{u}.")]
    return layers[max(units, key=len)] if units else None


def test_no_import_circle_among_the_package_modules():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            raise AssertionError("import circle: " + " -> ".join(m or "areal_hpc" for m in circle))


def test_no_module_imports_one_in_a_higher_layer():
    layers = _layers()
    assert len(set(layers.values())) >= 8, f"the Layers section of {ARCHITECTURE.name} was not read: {layers}"
    graph = _import_graph()
    unplaced = sorted(m or "areal_hpc" for m in graph if _layer_of(m, layers) is None)
    assert not unplaced, f"modules in no layer of {ARCHITECTURE.name}: {unplaced}"
    upward = [
        f"{m or 'areal_hpc'} -> {d or 'areal_hpc'} (layer {_layer_of(m, layers)} -> {_layer_of(d, layers)})"
        for m in sorted(graph)
        for d in sorted(graph[m])
        if _layer_of(d, layers) > _layer_of(m, layers)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_top_level_holds_at_most_twelve_loose_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 12, f"{len(loose)} loose modules at areal_hpc/'s top level (at most 12): {loose}"


def test_every_line_of_the_architecture_page_fits_a_screen():
    long = [f"{i}: {len(line)}" for i, line in enumerate(ARCHITECTURE.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, f"lines of {ARCHITECTURE.name} over 120 characters (line: length): {long}"


def test_the_message_table_points_at_lines_that_name_each_message():
    rows = {m.group(1): line for line in _section("Messages") if (m := re.match(r"^\| ([A-Z_]+) +\|", line))}
    assert set(rows) == set(Tag.__members__), f"messages in the table: {sorted(rows)}"
    wrong = []
    for tag, row in rows.items():
        places = re.findall(r"`([\w/]+\.py):(\d+)`", row)
        assert len(places) >= 2, f"{tag}: a sender and a handler, each as `file.py:line`"
        for file, line in places:
            lines = (PACKAGE / "runtime" / file).read_text().splitlines()
            if int(line) > len(lines) or not re.search(rf"\bTag\.{tag}\b", lines[int(line) - 1]):
                wrong.append(f"{tag}: runtime/{file}:{line} does not name Tag.{tag}")
    assert not wrong, "the message table of docs/architecture.md is out of date:\n" + "\n".join(wrong)


def test_the_route_from_prompt_to_weights_names_at_most_fifteen_files():
    files = set(re.findall(r"`([\w/]+\.py)", "\n".join(_section("The asynchronous roles"))))
    assert 5 <= len(files) <= 15, f"the route names {len(files)} files: {sorted(files)}"
    missing = [f for f in files if not (PACKAGE / f).exists()]
    assert not missing, f"files the route names that are not under areal_hpc/: {missing}"
