"""The test kit's LocalStack server: S3 only, on 127.0.0.1 only, with a storage
directory of its own, and a clear error where its virtualenv is missing."""

from __future__ import annotations

import http.client
import os
import subprocess
from pathlib import Path

import pytest
from cloudckpt_testkit import LocalStackServer
from cloudckpt_testkit.servers import localstack_python

TESTKIT = Path(__file__).resolve().parents[1] / "testkit"


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = [raw[i:i + 4][::-1] for i in range(0, size, 4)]
            addr = b"".join(words)
            text = ".".join(str(b) for b in addr) if size == 4 else addr.hex()
            found.add((text, int(port_hex, 16)))
    return found


def test_it_listens_on_127_0_0_1_alone(localstack_server: LocalStackServer) -> None:
    proc = localstack_server._proc
    assert proc is not None
    assert _listening(proc.pid) == {("127.0.0.1", localstack_server.port)}


def test_it_keeps_connections_alive_as_s3_does(localstack_server: LocalStackServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", localstack_server.port, timeout=10)
    try:
        for _ in range(3):
            conn.request("GET", "/_localstack/health")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            assert resp.getheader("Connection", "").lower() != "close"
        sock = conn.sock
        conn.request("GET", "/_localstack/health")
        conn.getresponse().read()
        assert conn.sock is sock  # the same connection served every request
    finally:
        conn.close()


def test_each_instance_keeps_its_objects_in_its_own_directory(tmp_path: Path) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    servers = [LocalStackServer(root=r) for r in roots]
    try:
        for server in servers:
            server.start()
        servers[0].create_bucket("only-in-a")
        client = servers[0]._client()
        client.put_object(Bucket="only-in-a", Key="k", Body=os.urandom(8 << 20))
        client.close()
        b = servers[1]._client()
        assert [x["Name"] for x in b.list_buckets().get("Buckets", [])] == []
        b.close()
        # What LocalStack writes goes below each instance's root, not to directories
        # every instance on the machine shares (its objects' spill files are unlinked as
        # soon as they are made, so the directories are what shows).
        for root in roots:
            assert (root / "tmp" / "localstack").is_dir()
        assert (roots[0] / "s3" / "only-in-a").is_dir()
        assert not (roots[1] / "s3" / "only-in-a").exists()
    finally:
        for server in servers:
            server.stop()


def test_a_fresh_instance_removes_the_directory_it_made() -> None:
    server = LocalStackServer()
    with server:
        assert os.path.isdir(server.root)
    assert not os.path.exists(server.root)


def test_a_missing_virtualenv_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("CLOUDCKPT_LOCALSTACK_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(RuntimeError, match="make setup"):
        LocalStackServer(root=tmp_path / "root").start()


def test_the_python_finder_says_what_to_install_when_none_fits(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no pyenv, uv or 3.12+ there
    done = subprocess.run([str(TESTKIT / "localstack-python")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert done.stdout == ""
    assert "no CPython 3.12 or newer" in done.stderr and "LOCALSTACK_PYTHON" in done.stderr


def test_the_python_finder_finds_the_one_named(tmp_path: Path) -> None:
    python = localstack_python()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LOCALSTACK_PYTHON": python}
    done = subprocess.run([str(TESTKIT / "localstack-python")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == python
