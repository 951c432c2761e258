"""Every MINIDIST_* environment variable is read, checked and listed in one place (minidist/host/env.py):
a bad value is one line naming the variable, the value and what it accepts; exit code 2 from
the training command, an EnvError (a ValueError) from ``import minidist.comm``."""
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from minidist.host import env
from minidist.host.launcher import mpiexec_command
from minidist.train.testing import run_train

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--steps", "1", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--peak-gflops", "10", "--eval-batches", "1", "--quiet"]

# (variable, bad value): the list, then one more of each kind.
BAD = [("MINIDIST_TIMEOUT_S", "abc"), ("MINIDIST_TIMEOUT_S", "-5"), ("MINIDIST_TIMEOUT_S", "nan"),
       ("MINIDIST_LINK_GBPS", "abc"), ("MINIDIST_LINK_LATENCY_US", "-5"), ("MINIDIST_FAST_PATH", "maybe"),
       ("MINIDIST_CHECK_COLLECTIVES", "xyz"),
       ("MINIDIST_TIMEOUT_S", "inf"), ("MINIDIST_LINK_GBPS", "0"), ("MINIDIST_LINK_LATENCY_US", "1e999"),
       ("MINIDIST_COLLECTIVE_TAGS", "2"), ("MINIDIST_BACKEND", "torch"), ("MINIDIST_LINK_SCOPE", "nodes"),
       ("MINIDIST_RANKS_PER_NODE", "0"), ("MINIDIST_RANKS_PER_NODE", "1.5"), ("MINIDIST_HANG_AFTER_S", "0")]
IDS = [f"{name}={value}" for name, value in BAD]


def _clean_environ(**extra) -> dict:
    """This process's environment without any MINIDIST_* variable, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MINIDIST_")}, **extra}


@pytest.mark.parametrize("name, value", BAD, ids=IDS)
def test_check_all_names_the_bad_variable_in_one_line(name, value):
    environ = _clean_environ(**{name: value})
    with pytest.raises(env.EnvError) as err:
        env.check_all(environ=environ)
    msg = str(err.value)
    assert msg == f"{name}={value!r}: expected {env.VARIABLES[name].accepts}", msg
    assert "\n" not in msg and isinstance(err.value, ValueError)
    with pytest.raises(env.EnvError, match=re.escape(f"{name}={value!r}")):
        env.get(name, environ)
    assert str(env.problem(environ)) == msg

    class InputError(ValueError):
        pass

    with pytest.raises(InputError) as err:  # the training command raises its own input error
        env.check_all(InputError, environ)
    assert str(err.value) == msg


def test_good_values_defaults_and_empty_values():
    environ = _clean_environ()
    assert env.problem(environ) is None
    env.check_all(environ=environ)
    for name, var in env.VARIABLES.items():
        assert env.get(name, environ) == var.default
        assert env.get(name, {name: "  "}) == var.default  # set but empty: the default
    good = {"MINIDIST_TIMEOUT_S": (" 7.5 ", 7.5), "MINIDIST_LINK_GBPS": ("0.05", 0.05),
            "MINIDIST_LINK_LATENCY_US": ("0", 0.0), "MINIDIST_FAST_PATH": ("Off", False),
            "MINIDIST_CHECK_COLLECTIVES": ("yes", True), "MINIDIST_COLLECTIVE_TAGS": ("0", False),
            "MINIDIST_BACKEND": ("NumPy", "numpy"), "MINIDIST_LINK_SCOPE": ("internode", "internode"),
            "MINIDIST_RANKS_PER_NODE": ("2", 2), "MINIDIST_HANG_DIR": ("/tmp/x", "/tmp/x"),
            "MINIDIST_HANG_AFTER_S": ("100", 100.0), "MINIDIST_TEST_KILL_IN_SAVE": ("1:renamed:4", (1, "renamed", 4)),
            "MINIDIST_OPS_PATH": ("Whole", "whole"), "MINIDIST_CUDA_AWARE_MPI": ("1", True),
            "MINIDIST_CUDA_KERNELS": ("OFF", "off"), "MINIDIST_CUBLAS_BATCHED": ("Off", "off"), "MINIDIST_FLASH_MMA": ("off", "off"),
            "MINIDIST_CAUSAL_BLOCKS": (" 8 ", 8), "MINIDIST_RESTART": ("2", 2), "MINIDIST_TEST_LOST_RANKS": ("1", 1)}
    assert set(good) == set(env.VARIABLES)
    for name, (text, value) in good.items():
        assert env.get(name, {name: text}) == value, name
    with pytest.raises(KeyError, match="MINIDIST_NO_SUCH"):
        env.get("MINIDIST_NO_SUCH")


def test_every_variable_the_code_names_is_in_the_table_and_the_readme():
    """The table lists every MINIDIST_* name the library uses; the README's section
    "Environment variables" is the table (env.readme_table())."""
    used = set()
    for path in (ROOT / "minidist").rglob("*.py"):
        used |= set(re.findall(r"MINIDIST_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert used - set(env.VARIABLES) == set(), "add these to minidist/host/env.py's VARIABLES"
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Environment variables\n", 1)
    assert len(section) == 2, "README.md has no section '## Environment variables'"
    assert env.readme_table() in section[1].split("\n## ", 1)[0], \
        "README's table differs from minidist.host.env.readme_table(); paste its output"
    for name, var in env.VARIABLES.items():
        assert var.meaning and var.accepts and "\n" not in var.meaning, name


def test_env_imports_nothing_heavy():
    code = "import sys, minidist.host.env; assert not {'numpy', 'mpi4py'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("name, value", BAD[:7], ids=IDS[:7])
def test_training_command_refuses_a_bad_variable_with_one_line_and_exit_code_2(name, value):
    r = run_train(None, TINY, timeout=120, env={name: value})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("minidist-train: error: ") and f"{name}={value!r}: expected" in lines[0], lines[0]
    assert r.stdout == ""


@pytest.mark.mpi
def test_a_library_script_under_mpiexec_fails_fast_naming_the_variable(tmp_path):
    """A user's script that imports minidist.comm, with a bad MINIDIST_TIMEOUT_S: every rank
    stops at the import with a few lines naming the variable (no hang, no long traceback)."""
    script = tmp_path / "script.py"
    script.write_text("import numpy as np\nfrom minidist import comm\n"
                      "print(comm.all_reduce(np.ones(4), comm.world()))\n")
    t0 = time.monotonic()
    r = subprocess.run(mpiexec_command(2) + [sys.executable, str(script)], capture_output=True, text=True,
                       timeout=60, env=_clean_environ(MINIDIST_TIMEOUT_S="abc"))
    assert time.monotonic() - t0 < 30
    assert r.returncode != 0
    out = r.stdout + r.stderr
    line = "minidist.host.env.EnvError: MINIDIST_TIMEOUT_S='abc': expected seconds >= 0 (0 turns the watchdog off)"
    assert out.count(line) == 2, out  # each rank, once
    per_rank = [ln for ln in out.splitlines() if ln.strip()]
    assert len(per_rank) <= 2 * 8 + 10, out  # a traceback of a few lines per rank (plus mpiexec's own)


@pytest.mark.mpi
def test_a_bad_variable_read_after_start_up_is_one_line_per_rank_through_the_abort_hook():
    """A variable first read once the job runs (comm.world() installed the abort hook) ends the
    job with "[rank r] minidist: <message>", no traceback."""
    from minidist.train.testing import MPIJobFailed, run_mpi

    with pytest.raises(MPIJobFailed) as err:
        run_mpi(2, f"{ROOT / 'tests' / 'mpi' / 'env_bodies.py'}::late_read", timeout=60)
    msg = str(err.value)
    for r in range(2):
        assert f"[rank {r}] minidist: MINIDIST_RANKS_PER_NODE='many': expected an integer >= 1" in msg, msg
    assert "Traceback" not in msg and "timed out after" not in msg, msg
