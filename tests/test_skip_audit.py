"""--allowed-skips (tests/conftest.py: SkipAudit), as .ci/run uses it, on a suite of two tests run by pytest
in a process of its own: an unlisted skip and a stale line fail the run, a listed skip passes where its
condition holds."""

import subprocess
import sys

from tests.conftest import REPO, SKIP_CONDITIONS

TWO_TESTS = """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("a reason")
"""


def audited(tmp_path, allowed: str, tests: str = TWO_TESTS, *args: str) -> subprocess.CompletedProcess:
    """pytest on `tests` with `allowed` as the file of allowed skips; a package flash_attn importable."""
    (tmp_path / "test_two.py").write_text(tests)
    (tmp_path / "allowed.txt").write_text(f"# a comment line\n{allowed}\n")
    (tmp_path / "packages" / "flash_attn").mkdir(parents=True, exist_ok=True)
    (tmp_path / "packages" / "flash_attn" / "__init__.py").touch()
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-o", "testpaths=test_two.py",
                           f"--allowed-skips={tmp_path}/allowed.txt", *args],
                          cwd=tmp_path, env={"PYTHONPATH": f"{REPO}:{tmp_path}/packages", "PATH": ""},
                          capture_output=True, text=True)


def test_a_skip_is_allowed_only_where_a_line_lists_it_and_its_condition_holds(tmp_path):
    out = audited(tmp_path, "test_two.py::test_runs  no-gpu  # not the test that skips")
    assert (out.returncode == 1
            and "SKIP AUDIT: test_two.py::test_skips skipped (Skipped: a reason): " in out.stdout), out.stdout
    out = audited(tmp_path, "test_two.py::test_sk*  no-gpu  # why")
    assert out.returncode == (0 if SKIP_CONDITIONS["no-gpu"]() else 1), out.stdout
    out = audited(tmp_path, "test_two.py::test_skips  no-flash-attn  # flash-attn is importable there")
    assert out.returncode == 1 and "does not allow it on this machine" in out.stdout, out.stdout
    assert "1 passed, 1 skipped" in out.stdout, out.stdout  # the run itself went as before


def test_a_line_that_matches_no_test_fails_a_whole_suite_run(tmp_path):
    out = audited(tmp_path, "test_two.py::test_gone  no-gpu", TWO_TESTS.split("def test_skips")[0])
    assert out.returncode == 1 and "test_two.py::test_gone matches no test that ran" in out.stdout, out.stdout
    out = audited(tmp_path, "test_two.py::test_gone  no-gpu", TWO_TESTS.split("def test_skips")[0], "-k", "test_")
    assert out.returncode == 0, out.stdout  # a selection, where not every test runs
