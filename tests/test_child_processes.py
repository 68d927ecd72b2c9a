"""tests/child_processes.py: a test's children and their descendants die with the test, also when
the test run is interrupted (SIGINT, or SIGTERM as a CI timeout sends it)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.child_processes import ChildProcesses

REPO = pathlib.Path(__file__).resolve().parents[1]


def _gone(pid: int, timeout: float = 10.0) -> bool:
  """Whether process `pid` has ended (a zombie counts as ended) within `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
      return True
    if state == "Z":
      return True
    time.sleep(0.05)
  return False


def test_leaving_the_block_kills_children_and_their_descendants():
  with pytest.raises(RuntimeError), ChildProcesses() as children:
    shell = children.start(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE,
                           text=True)
    grandchild = int(shell.stdout.readline())
    raise RuntimeError("the test failed")
  assert _gone(shell.pid) and _gone(grandchild)


# `python -m pytest` with SIGINT raising KeyboardInterrupt, as in an interactive test run. A
# process started in the background by a non-interactive shell (`cmd &`, as a CI script may start
# this test run) inherits SIGINT ignored, and so would the inner run. (Resetting it in the child
# with preexec_fn would run Python between fork and exec in this multithreaded JAX process.)
PYTEST_WITH_SIGINT = ("import runpy, signal, sys;"
                      " signal.signal(signal.SIGINT, signal.default_int_handler);"
                      " sys.argv[0] = 'pytest'; runpy.run_module('pytest', run_name='__main__')")


INTERRUPTED_TEST = '''
import time

def test_starts_a_child_then_hangs(children):
  child = children.start(["sleep", "600"])
  with open({pid_file!r}, "w") as file:
    file.write(str(child.pid))
  time.sleep(600)
'''


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_a_test_run_kills_its_children(signum, tmp_path):
  pid_file = tmp_path / "child.pid"
  (tmp_path / "test_hangs.py").write_text(INTERRUPTED_TEST.format(pid_file=str(pid_file)))
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  with ChildProcesses() as children:  # the inner pytest itself
    run = children.start([sys.executable, "-c", PYTEST_WITH_SIGINT, "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-p", "tests.conftest",
                          str(tmp_path / "test_hangs.py")],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    deadline = time.monotonic() + 120
    while not pid_file.is_file() or not pid_file.read_text():
      assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()
      time.sleep(0.1)
    child = int(pid_file.read_text())
    assert not _gone(child, timeout=0.2)
    run.send_signal(signum)
    try:
      output, _ = run.communicate(timeout=120)
    except subprocess.TimeoutExpired:
      # Still running: SIGABRT makes pytest's faulthandler print every thread's stack first.
      run.send_signal(signal.SIGABRT)
      output, _ = run.communicate(timeout=60)
      pytest.fail(f"the run did not end within 120 s of the signal; its output:\n{output}")
    assert _gone(child), output
