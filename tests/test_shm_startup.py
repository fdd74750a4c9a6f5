"""The target's shm dir at startup, through real target processes.

- A shm dir too small for the pool (a 2 MiB tmpfs, mounted in a private mount
  namespace) is a startup error naming the folder, the size needed and the size free;
  the target never reports SERVING, exits non-zero and leaves no pool file (it used to
  serve on a sparse file and die of SIGBUS at the first writes).
- What anyone may put in /dev/shm under a pool file's name — a FIFO, a link to a FIFO
  elsewhere, another user's file — neither stalls startup nor is touched by the
  stale-file cleanup, which still removes a dead target's own pool file.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT, Service
from tests.tiny_models import make_qwen3

DEAD_PID = 999_999_999  # above any pid_max: never a live process
MOUNT_AND_RUN = ('dir="$1"; shift; mount -t tmpfs -o size=2m tmpfs "$dir" || exit 99; "$@"; rc=$?; '
                 'echo "left in the shm dir: [$(ls -A "$dir")]"; exit $rc')


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("shm-startup") / "model")


def private_mount_namespace(probe_dir: Path) -> list[str]:
    """The command prefix that runs a command in a private mount namespace where it may
    mount a tmpfs (a user namespace too when not root); skips the test when there is none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs privately")
    prefix = [unshare, "--mount"] if os.geteuid() == 0 else [unshare, "--user", "--map-root-user", "--mount"]
    probe = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe_dir)],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {probe.stderr.strip()}")
    return prefix


def test_a_shm_dir_too_small_for_the_pool_is_a_clear_startup_error(tiny_model, tmp_path):
    tiny = tmp_path / "tiny-shm"
    tiny.mkdir()
    prefix = private_mount_namespace(tiny)
    log_path = tmp_path / "target.log"
    cmd = [*prefix, "sh", "-c", MOUNT_AND_RUN, "sh", str(tiny), sys.executable, "-m", "target_service.cli",
           "--model", str(tiny_model), "--port", "0", "--metrics-port", "0", "--shm-dir", str(tiny),
           "--num-pages", "4096", "--dtype", "float32"]  # 8 KiB a float32 page: 32 MiB on a 2 MiB tmpfs
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if "target_service.server: serving " in log_path.read_text(errors="replace"):
                pytest.fail(f"the target reported SERVING on a pool the shm dir cannot hold:\n{log_path.read_text()}")
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # unshare, the shell and the target under it
        proc.wait()
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 1, log
    assert "target_service.server: serving " not in log
    match = re.search(r"the KV pool needs ([\d.]+) MiB in (\S+), which has ([\d.]+) MiB free", log)
    assert match is not None, log
    needed, folder, free = float(match[1]), match[2], float(match[3])
    assert folder == str(tiny) and needed >= 32.0 and free <= 2.0, match[0]
    assert "left in the shm dir: []" in log, log  # the half-made pool file is gone


def test_fifos_links_and_foreign_files_in_the_shm_dir_neither_stall_startup_nor_go(tiny_model, shm_dir, tmp_path):
    fifo = shm_dir / f"splitspec-f1f0-{DEAD_PID}-e0.kv"
    os.mkfifo(fifo, 0o600)
    fifo_elsewhere = tmp_path / "elsewhere.fifo"
    os.mkfifo(fifo_elsewhere, 0o600)
    link = shm_dir / f"splitspec-11c4-{DEAD_PID}-e0.kv"
    link.symlink_to(fifo_elsewhere)
    stale = shm_dir / f"splitspec-57a1e-{DEAD_PID}-e0.kv"  # a dead target's own pool file
    stale.write_bytes(b"an old pool")
    stale.chmod(0o600)
    planted = [fifo, link]
    if os.geteuid() == 0:
        foreign = shm_dir / f"splitspec-f0e1-{DEAD_PID}-e0.kv"
        foreign.write_bytes(b"not ours")
        os.chown(foreign, 65534, 65534)  # nobody
        planted.append(foreign)
    target = Service("target_service.cli", ["--model", str(tiny_model), "--port", "0", "--shm-dir", str(shm_dir),
                                            "--num-pages", "64"], tmp_path / "target.log")
    try:
        target.wait_serving(timeout=120)  # the old cleanup blocked forever opening the FIFO
        assert all(os.path.lexists(p) for p in planted), "the cleanup removed a file that is not a pool of ours"
        assert fifo_elsewhere.exists() and not stale.exists()
        assert "removed 1 stale KV pool file(s)" in target.log()
        assert target.stop() == 0, target.log()
    finally:
        target.kill()
        for path in planted:
            path.unlink(missing_ok=True)
