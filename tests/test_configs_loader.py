"""`python -m train` refuses bad input before doing any work: unknown config keys, unwritable workdirs."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=120)


def test_unknown_config_key_fails_naming_it_and_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  proc = _train(f"--workdir={workdir}", "--config.train.stepz=3")
  assert proc.returncode == 2
  assert "unknown config key 'train.stepz'" in proc.stderr and "did you mean 'train.steps'" in proc.stderr
  assert not workdir.exists()

  proc = _train(f"--workdir={workdir}", "--config.train.steps=many")
  assert proc.returncode == 2 and "'train.steps' expects int" in proc.stderr
  assert not workdir.exists()


def test_unwritable_workdir_fails_with_the_path_and_the_fix(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  workdir = blocker / "run"  # cannot be created, whoever runs the test (root ignores permission bits)
  proc = _train(f"--workdir={workdir}", "--config.train.steps=1")
  assert proc.returncode == 2
  assert f"cannot create workdir {workdir}" in proc.stderr and "choose another --workdir" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_workdir_check_refuses_a_read_only_directory(tmp_path, monkeypatch):
  from train.core import loop
  monkeypatch.setattr(os, "access", lambda path, mode: False)  # what a read-only directory reports
  with pytest.raises(loop.WorkdirError, match=f"workdir {tmp_path} is not writable; choose another --workdir"):
    loop.check_workdir(str(tmp_path))


def test_workdir_check_refuses_urls():
  from train.core import loop
  with pytest.raises(loop.WorkdirError, match="URLs are not supported.*gcsfuse"):
    loop.check_workdir("gs://bucket/run")


def test_a_refused_start_leaves_no_workdir_and_a_file_is_named(tmp_path):
  """A start refused after the workdir was made (a mesh these devices cannot form) removes the empty directory it
  made; a --workdir that is a file is refused as one."""
  workdir = tmp_path / "new_run"
  proc = _train(f"--workdir={workdir}", "--config.mesh.data=3", "--config.train.steps=1")
  assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr
  assert not workdir.exists()
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  proc = _train(f"--workdir={blocker}", "--config.train.steps=1")
  assert proc.returncode == 2 and f"workdir {blocker} is a file, not a directory" in proc.stderr
  assert blocker.read_text() == "not a directory"
