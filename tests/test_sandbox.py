"""Tests for the code reward and its sandbox: right and wrong code, hostile programs, the pool, config refusals."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load_config
from areal_hpc.config.checks import _CHOICES
from areal_hpc.data import load_math_dataset
from areal_hpc.reward import code_reward, isolation, reward_pool_for
from areal_hpc.reward.code import extract_last_python_block
from areal_hpc.reward.sandbox import MODES

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "jobs" / "code_1p5b_gpu.yaml"
TASKS = ROOT / "jobs" / "data" / "code_tasks.jsonl"

HAVE_BWRAP = isolation("auto").name == "bwrap"
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap cannot run here (env/setup.sh installs it)")
BOTH = ["auto", pytest.param("none", id="rlimits-only")]
# Under rlimits only, code run by an ordinary user (not root, so not dropped to nobody) may signal this process.
CAN_SIGNAL_US = not HAVE_BWRAP and os.geteuid() != 0

ADD_TESTS = "assert add(1, 2) == 3\nassert add(-4, 4) == 0"
GOOD = "I add them.\n```python\ndef add(a, b):\n    return a + b\n```\nDone."


def block(code: str) -> str:
    return "Here is my answer.\n```python\n" + textwrap.dedent(code).strip() + "\n```\n"


def hostile(code: str) -> str:
    """A correct add() that first does something the sandbox must stop (so any score of 1 is a breach)."""
    return block(textwrap.dedent(code).strip() + "\n\ndef add(a, b):\n    return a + b")


def score(completion: str, mode: str = "auto", timeout_s: float = 2.0, **kw) -> tuple[float, float]:
    t0 = time.monotonic()
    r = code_reward(completion, kw.pop("tests", ADD_TESTS), timeout_s=timeout_s, sandbox=mode, **kw)
    return r, time.monotonic() - t0


def still_scores_one(mode: str = "auto") -> None:
    assert score(GOOD, mode)[0] == 1.0


# ----------------------------------------------------------------- right and wrong code


def test_the_last_python_block_is_the_answer():
    text = "```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\n```python\nunclosed"
    assert extract_last_python_block(text) == "x = 2\n"
    assert extract_last_python_block("```\nx = 3\n```") is None  # an untagged block may be output, not code
    assert extract_last_python_block("no code") is None


@pytest.mark.parametrize("mode", BOTH)
def test_correct_code_scores_one_and_wrong_code_zero(mode):
    assert score(GOOD, mode)[0] == 1.0
    assert score(block("def add(a, b):\n    return a - b"), mode)[0] == 0.0
    assert score("def add(a, b): return a + b", mode)[0] == 0.0  # no fenced block
    assert score(block("def add(a, b):\n    return a +"), mode)[0] == 0.0  # syntax error
    # the earlier block was right, the last one is the answer
    assert score(GOOD + block("def add(a, b):\n    return 0"), mode)[0] == 0.0


@pytest.mark.parametrize(
    "trick",
    [
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "raise SystemExit(0)",
        "print('ok')\nimport os\nos._exit(0)",
        "import builtins\nbuiltins.exec = lambda *a, **k: None",  # the tests would never run
        "import os\nos._exit = lambda code: None\nos.write = lambda fd, data: len(data)",
    ],
)
def test_code_that_exits_before_the_tests_scores_zero(trick):
    # exit code 0 alone is not success: the tests must have run and passed
    assert score(block(trick), tests="assert False")[0] == 0.0


def test_the_solution_may_use_its_private_directory():
    code = """
    import os
    with open("scratch.txt", "w") as f:
        f.write("kept")
    def add(a, b):
        return a + b if open("scratch.txt").read() == "kept" else None
    """
    assert score(block(code))[0] == 1.0


# ----------------------------------------------------------------- hostile programs fail safely


def _new_sandbox_processes(before: list[int]) -> set[int]:
    """Sandbox processes that were not there before (one of those may have ended meanwhile)."""
    return set(_sandbox_leftovers()) - set(before)


@pytest.mark.parametrize("mode", BOTH)
def test_an_infinite_loop_is_stopped_at_the_timeout(mode):
    # Neither program ever ends by itself: that the calls came back is the stop (CPU limit or wall timeout, then
    # killpg). How long it took depends on the machine's load, so it is not asserted.
    busy, _ = score(hostile("while True:\n    pass"), mode, timeout_s=1.5)
    asleep, _ = score(hostile("import time\nwhile True:\n    time.sleep(0.1)"), mode, timeout_s=1.5)
    assert (busy, asleep) == (0.0, 0.0)
    still_scores_one(mode)


def _sandbox_leftovers() -> list[int]:
    """Live (not zombie) processes of the user the sandbox runs as (nobody, when the tests run as root)."""
    if os.geteuid() != 0:
        return []
    out = subprocess.run(["ps", "-u", "nobody", "-o", "pid=,stat="], capture_output=True, text=True).stdout
    return [int(pid) for pid, stat in (ln.split() for ln in out.splitlines()) if not stat.startswith("Z")]


@pytest.mark.parametrize("mode", BOTH)
def test_a_fork_bomb_is_stopped_by_the_process_limit(mode):
    # bounded at 2000 sleeping children, so a broken sandbox cannot take this machine down
    bomb = """
    import os, time
    for _ in range(2000):
        if os.fork() == 0:
            time.sleep(900)
            os._exit(0)
    """
    before = _sandbox_leftovers()
    # children that sleep past a wall timeout far beyond any load: back before it, the bomb was stopped and its
    # children were not waited for
    r, took = score(hostile(bomb), mode, timeout_s=600)
    assert r == 0.0 and took < 600
    end = time.monotonic() + 30  # (a hang guard) a killed process is gone once the kernel has torn it down
    while _new_sandbox_processes(before) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _new_sandbox_processes(before)  # every child died with the sandbox
    still_scores_one(mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's processes are told apart by their user, nobody, as root")
@pytest.mark.parametrize("mode", BOTH)
def test_the_sandbox_dies_with_its_scorer(mode):
    # a scorer killed mid-answer (the pool kills hung workers) must not leave the answer running
    script = textwrap.dedent(
        f"""
        from areal_hpc.reward import code_reward
        code_reward("```python\\nimport time\\ntime.sleep(60)\\n```", "assert 1", timeout_s=60, sandbox={mode!r})
        """
    )
    before = _sandbox_leftovers()
    scorer = subprocess.Popen([sys.executable, "-c", script])
    try:
        end = time.monotonic() + 30
        while not _new_sandbox_processes(before) and time.monotonic() < end:
            time.sleep(0.1)
        assert time.monotonic() < end
        time.sleep(0.5)  # the sleeping answer is up
    finally:
        scorer.kill()
        scorer.wait()
    end = time.monotonic() + 30  # a hang guard
    while _new_sandbox_processes(before) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _new_sandbox_processes(before)


@pytest.mark.parametrize("mode", BOTH)
def test_a_10_gb_allocation_fails_fast(mode):
    # A wall timeout far beyond any load: ending before it means the memory limit refused the allocation.
    r, took = score(hostile("x = bytearray(10 * 1024**3)"), mode, timeout_s=600)
    assert r == 0.0 and took < 600
    still_scores_one(mode)


@needs_bwrap
def test_a_socket_connect_to_localhost_reaches_nothing():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"""
        import socket
        socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"leak")
        """
        assert score(hostile(code))[0] == 0.0
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever connected
    still_scores_one()


@needs_bwrap
def test_a_write_outside_the_sandbox_directory_leaves_no_file(tmp_path):
    target = tmp_path / "escaped.txt"
    assert score(hostile(f"open({str(target)!r}, 'w').write('out')"))[0] == 0.0
    # everywhere else it might try: the sandbox's own /tmp and / are private tmpfs, the rest read-only or absent
    name = f"escaped-{os.getpid()}-{tmp_path.name}.txt"
    places = ["/tmp/" + name, "../" + name, "/" + name, "/usr/" + name, str(ROOT / name), str(Path.home() / name)]
    code = f"""
    for p in {places!r}:
        try:
            open(p, "w").write("out")
        except OSError:
            pass
    """
    score(hostile(code))
    assert not target.exists()
    assert not [
        p for p in ["/tmp/" + name, "/" + name, "/usr/" + name, ROOT / name, Path.home() / name] if Path(p).exists()
    ]
    still_scores_one()


@needs_bwrap
def test_the_run_directory_and_the_home_directory_cannot_be_read(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "secret.txt").write_text("s3cret")
    os.chmod(tmp_path, 0o755)  # readable by anyone on the host: only the sandbox may stop the read
    os.chmod(run_dir / "secret.txt", 0o644)
    code = f"def secret():\n    return open({str(run_dir / 'secret.txt')!r}).read()"
    assert score(block(code), tests="assert secret() == 's3cret'")[0] == 0.0
    home = Path.home()
    listing = sorted(os.listdir(home))
    code = f"import os\ndef listing():\n    return sorted(os.listdir({str(home)!r}))"
    assert score(block(code), tests=f"assert listing() == {listing!r}")[0] == 0.0
    # the same reads, unsandboxed, would have passed
    assert open(run_dir / "secret.txt").read() == "s3cret"


@pytest.mark.parametrize("mode", BOTH)
def test_killing_the_parent_leaves_the_scorer_alive(mode):
    if mode == "none" and os.geteuid() != 0:
        pytest.skip("rlimits only, as an ordinary user, cannot stop this (docs/sandbox.md)")
    code = f"""
    import os, signal
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill({os.getpid()}, signal.SIGKILL)
    """
    parent = os.getppid()  # 1 already when the suite runs detached (nohup): then it must stay 1
    assert score(hostile(code), mode)[0] == 0.0
    assert os.getppid() == parent  # this process and its parent are alive (pytest would be gone otherwise)
    still_scores_one(mode)


@needs_bwrap
def test_signalling_every_process_reaches_only_the_sandbox():
    # kill(-1): every process the caller may signal; inside the pid namespace that is the sandbox alone
    assert score(hostile("import os, signal\nos.kill(-1, signal.SIGKILL)"))[0] == 0.0
    still_scores_one()


@pytest.mark.parametrize("mode", BOTH)
def test_printing_a_gigabyte_is_cut_short_with_bounded_memory(mode):
    code = """
    import sys
    chunk = "x" * (1 << 20)
    for _ in range(1024):
        sys.stdout.write(chunk)
    sys.stdout.flush()
    """
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r, took = score(hostile(code), mode, timeout_s=600)
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert r == 0.0 and took < 600, took  # stopped at the file-size limit, not at the (far) timeout
    assert grew_mb < 50, grew_mb
    still_scores_one(mode)


# ----------------------------------------------------------------- the pool, the data, the config


@pytest.mark.skipif(CAN_SIGNAL_US, reason="rlimits only, as an ordinary user: a hostile answer could kill pytest")
def test_the_reward_pool_scores_a_code_batch_end_to_end(tmp_path):
    cfg = load_config(RECIPE, ["model.path=/m", "reward.num_workers=2", "reward.timeout_s=2", "reward.sandbox=auto"])
    completions = [
        GOOD,
        block("def add(a, b):\n    return a * b"),
        hostile(f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({os.getpid()}, signal.SIGKILL)"),
        hostile("while True:\n    pass"),
        "no code at all",
        GOOD.replace("a + b", "b + a"),
    ]
    with reward_pool_for(cfg) as pool:
        assert pool.scorer is not None and pool.timeout_s > cfg.reward.timeout_s
        scores = pool.submit(completions, [ADD_TESTS] * len(completions)).result(timeout=120)
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert pool.rebuilds == 0  # no hostile answer took a worker down


def test_every_shipped_code_task_is_solved_by_its_solution_and_not_by_a_stub():
    rows = [json.loads(line) for line in TASKS.read_text().splitlines()]
    assert 20 <= len(rows) <= 50
    assert len({r["task_id"] for r in rows}) == len(rows)
    cfg = load_config(RECIPE, ["model.path=/m", "reward.num_workers=2", "reward.sandbox=auto"])
    solutions = ["```python\n" + r["solution"] + "```" for r in rows]
    stubs = ["```python\ndef f():\n    pass\n```"] * len(rows)
    with reward_pool_for(cfg) as pool:
        scores = pool.score(solutions + stubs, [r["tests"] for r in rows] * 2)
    assert scores == [1.0] * len(rows) + [0.0] * len(rows)


def test_code_rows_carry_their_tests_and_malformed_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "code.jsonl"
    rows = [
        {"prompt": "p1", "tests": "assert f() == 1"},
        {"prompt": "p2", "tests": ["assert f() == 1", "assert f() != 2"]},
        {"prompt": "p3", "tests": ""},
        {"prompt": "p4", "tests": 7},
        {"prompt": "", "tests": "assert True"},
        {"prompt": "p6"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_math_dataset(path, "code", "prompt", "tests", "{question}", heldout_size=0)
    assert sorted(p.answer for p in ds.train) == ["assert f() == 1", "assert f() == 1\nassert f() != 2"]
    assert ds.skipped_rows == 5
    assert ds.skip_reasons == {"missing or empty 'tests'": 3, "missing or empty 'prompt'": 1, "not a JSON object": 1}
    assert any("skipped 5 malformed rows" in str(w.message) for w in caught)


def test_the_code_recipe_loads_and_the_sandbox_modes_agree():
    cfg = load_config(RECIPE, ["model.path=/models/x"])
    assert (cfg.data.kind, cfg.reward.sandbox, cfg.trainer.warm_start_steps) == ("code", "bwrap", 0)
    assert tuple(_CHOICES["reward.sandbox"]) == MODES


@pytest.mark.parametrize(
    "override, words",
    [
        ("reward.sandbox=docker", "reward.sandbox='docker' is not allowed; choose one of bwrap, auto, none"),
        ("trainer.warm_start_steps=5", "warm_start_steps must be 0 with data.kind=code"),
        ("data.path=''", "data.path is empty; data.kind=code needs a dataset file"),
        ("reward.code_memory_mb=8", "reward.code_memory_mb=8 is out of range"),
    ],
)
def test_bad_code_settings_are_refused_with_one_line(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, ["model.path=/m", override])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_run_refuses_to_start_when_the_configured_isolation_is_unavailable(tmp_path):
    # A machine without bubblewrap: the same interpreter with a PATH on which bwrap is not found.
    script = textwrap.dedent(
        f"""
        from areal_hpc.config import load_config
        from areal_hpc.reward import SandboxUnavailable, isolation, reward_pool_for
        assert isolation("auto").name == "rlimits-only"
        try:
            reward_pool_for(load_config({str(RECIPE)!r}, ["model.path=/m"]))
        except SandboxUnavailable as err:
            print("REFUSED", err)
        """
    )
    env = {**os.environ, "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(lines) == 1, out.stdout
    assert "reward.sandbox=bwrap but bubblewrap cannot run here (bwrap is not on PATH)" in lines[0]
    assert "reward.sandbox=none" in lines[0]  # what to do instead
