"""A worker's threads start from the CPUs it may use: its affinity, capped by its cgroup's CPU
quota (v1 or v2, on its own group or an ancestor), not every core the machine has; ``--dry-run``
says what was chosen, and how OpenMP's threads wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tokenfleet.config.cpus import CpuShare, cgroup_quota

V1_MOUNTS = (
    "30 25 0:26 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
)
V2_MOUNTS = "29 24 0:25 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def fake_root(tmp_path: Path, cgroup: str, mounts: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mounts)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_v2_quota_on_the_group_or_an_ancestor_counts_the_tightest(tmp_path):
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        V2_MOUNTS,
        {
            "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000\n",
            "sys/fs/cgroup/kubepods/cpu.max": "400000 100000\n",
        },
    )
    assert cgroup_quota(root) == 1.5


def test_a_v1_cfs_quota_is_read_and_minus_one_means_none(tmp_path):
    files = {
        "sys/fs/cgroup/cpu/docker/abc/cpu.cfs_quota_us": "50000",
        "sys/fs/cgroup/cpu/docker/abc/cpu.cfs_period_us": "100000",
    }
    cgroup = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n"
    assert cgroup_quota(fake_root(tmp_path / "a", cgroup, V1_MOUNTS, files)) == 0.5
    files = {k: ("-1" if k.endswith("quota_us") else v) for k, v in files.items()}
    assert cgroup_quota(fake_root(tmp_path / "b", cgroup, V1_MOUNTS, files)) is None


def test_no_cgroup_files_mean_no_quota(tmp_path):
    assert cgroup_quota(tmp_path) is None
    assert cgroup_quota(fake_root(tmp_path / "c", "0::/\n", V2_MOUNTS, {})) is None


def test_threads_are_the_affinity_capped_by_the_quota_rounded_up():
    assert CpuShare(affinity=8, quota=None).threads == 8
    assert CpuShare(affinity=8, quota=2.0).threads == 2
    assert CpuShare(affinity=8, quota=1.5).threads == 2
    assert CpuShare(affinity=8, quota=0.25).threads == 1
    assert CpuShare(affinity=1, quota=4.0).threads == 1


def dry_run(tiny_model: str, env: dict[str, str], cpus: set[int] | None = None) -> dict:
    """``tokenfleet worker --dry-run`` in a process of its own (its affinity set before it starts)."""
    code = (
        "import os, sys\n"
        f"cpus = {sorted(cpus) if cpus else None!r}\n"
        "if cpus: os.sched_setaffinity(0, set(cpus))\n"
        "from tokenfleet.cli import main\n"
        f"sys.argv = ['tokenfleet', 'worker', '--model', {tiny_model!r}, '--dry-run']\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_dry_run_says_the_threads_and_the_wait_policy_chosen(tiny_model):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "TOKENFLEET_"))}
    first = min(os.sched_getaffinity(0))
    pinned = dry_run(tiny_model, env, {first})
    assert pinned["threads_chosen"].startswith("1 at start (1 CPU in its affinity)")
    assert pinned["omp_wait_policy"].startswith("OpenMP's default")
    everything = dry_run(tiny_model, env)["threads_chosen"]
    assert everything.startswith(f"{len(os.sched_getaffinity(0))} at start"), everything
    mine = dry_run(tiny_model, {**env, "OMP_WAIT_POLICY": "ACTIVE", "TOKENFLEET_THREADS": "3"}, {first})
    assert (
        mine["threads_chosen"] == "3 (--threads)" and mine["omp_wait_policy"] == "ACTIVE"
    )  # the user's word
