"""Checks over the package source: the run directory's layout lives in one module, the protocol's text
matches what is sent."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from areal_hpc.rundir import RunDir, SweepDir
from areal_hpc.runtime import protocol
from areal_hpc.runtime.protocol import FIELDS, GROUP_FIELDS, ProtocolError, Tag, check_fields

PACKAGE = Path(__file__).resolve().parents[1] / "areal_hpc"


def _layout_names() -> set[str]:
    """Every file and folder name RunDir and SweepDir hand out, relative to their roots."""
    run, sweep = RunDir("/r"), SweepDir("/s")
    names = set()
    for obj, root in ((run, run.root), (sweep, sweep.root)):
        for attr in dir(type(obj)):
            if isinstance(getattr(type(obj), attr), property):
                value = getattr(obj, attr)
                for p in value if isinstance(value, tuple) else [value]:
                    rel = Path(p).relative_to(root)
                    names.update(part for part in rel.parts)
    names.update({run.trainer_checkpoint(3).parent.name, run.weights_version(3).parent.name})
    return names - {"%j"}


# Words that are also run-dir names but mean something else where they stand: submitit's cluster kind and
# who submitted a job (a value in slurm/job.json).
NOT_PATHS = {
    ("launch/submit.py", "slurm", "cluster"),
    ("launch/submit.py", "submitit", "submitted_by"),
    ("launch/resume.py", "submitit", None),  # how a run was submitted (job.json's submitted_by), not a folder
    ("cli/slurm.py", "submitit", "flag_value"),
    ("trackers.py", "tensorboard", None),  # logging.trackers' names, defined once there
    ("trackers.py", "wandb", None),
    ("config.py", "tensorboard", None),  # the deprecated config key logging.tensorboard
}


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
    assert {"rollouts", "ledger", "checkpoints", "STOP", "config.yaml", "summary.json", "logs", "slurm"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rundir.py":
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
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if (rel, node.value if isinstance(node, ast.Constant) else None, meaning.get(id(node))) in NOT_PATHS:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                # a path piece: the whole string, or a piece between slashes (f-string parts included)
                pieces = set(re.split(r"[/\\]", node.value)) | {node.value}
                for hit in sorted(pieces & names):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {hit!r}")
    assert not found, "run-dir names outside areal_hpc/rundir.py:\n" + "\n".join(found)


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
            assert set(doc) == set(keys) | set(GROUP_FIELDS)
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
