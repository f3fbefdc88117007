"""HubServer against the real ``huggingface_hub`` client (plain Git LFS, no Xet)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cloudckpt_testkit.hubserver import HubServer
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

TOKEN = "hf_test_token"
REPO = "test-org/export"
MODEL_SIZE = 3 * 1024 * 1024

# huggingface_hub's own LFS PUT passes ``data=<file>`` to httpx2, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Isolate huggingface_hub: temp HF_HOME/cache, Xet off, online, no ambient token.

    The client reads these variables at import time, so the module constants are
    patched as well as the environment.
    """
    home = tmp_path / "hf_home"
    cache = home / "hub"
    env = {"HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "HF_HOME": str(home),
           "HF_HUB_CACHE": str(cache), "HF_TOKEN_PATH": str(home / "token")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    return cache


@pytest.fixture
def hub(hf_cache: Path, monkeypatch: pytest.MonkeyPatch):
    with HubServer(token=TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


def _export_folder(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": json.dumps({"hidden_size": 8, "layers": 2}).encode(),
        "model.safetensors": os.urandom(MODEL_SIZE),
        "tokenizer.json": json.dumps({"vocab": {"a": 0, "b": 1}}).encode(),
    }
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def _read_tree(folder: str | Path) -> dict[str, bytes]:
    base = Path(folder)
    return {
        p.relative_to(base).as_posix(): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and ".cache" not in p.relative_to(base).parts
    }


def _create_and_upload(hub: HubServer, tmp_path: Path) -> tuple[HfApi, dict[str, bytes], str]:
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    api.create_repo(REPO, repo_type="model", private=True, exist_ok=True)
    files = _export_folder(tmp_path / "export")
    info = api.upload_folder(repo_id=REPO, folder_path=tmp_path / "export",
                             commit_message="Export step 100")
    return api, files, info.oid


def test_upload_folder_then_snapshot_download(hub: HubServer, hf_cache: Path, tmp_path: Path):
    api, files, oid = _create_and_upload(hub, tmp_path)

    held = hub.files(REPO)
    assert {k: v for k, v in held.items() if k != ".gitattributes"} == files
    assert ".gitattributes" in held  # like the Hub's initial commit
    last = hub.commits(REPO)[-1]
    assert (last["oid"], last["ref"], last["title"]) == (oid, "main", "Export step 100")
    assert last["added"] == sorted(files)
    assert last["lfs"] == ["model.safetensors"]
    assert hub.refs(REPO) == {"main": oid}

    # The large file went through the LFS batch API and a PUT to the upload URL.
    methods_paths = hub.requests
    assert ("POST", f"/api/models/{REPO}/preupload/main") in methods_paths
    assert ("POST", f"/{REPO}.git/info/lfs/objects/batch") in methods_paths
    assert ("POST", f"/{REPO}.git/info/lfs/objects/verify") in methods_paths
    assert sum(m == "PUT" for m, _ in methods_paths) == 1

    assert api.repo_exists(REPO)
    assert not api.repo_exists("test-org/missing")
    info = api.model_info(REPO, revision=oid, files_metadata=True)
    assert info.sha == oid and info.private is True
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == set(held)
    lfs = siblings["model.safetensors"].lfs
    assert lfs is not None and lfs.size == MODEL_SIZE
    assert lfs.sha256 == hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert siblings["config.json"].lfs is None

    path = snapshot_download(REPO, endpoint=hub.endpoint, token=TOKEN, cache_dir=hf_cache)
    assert Path(path).name == oid
    assert _read_tree(path) == held

    local = snapshot_download(REPO, endpoint=hub.endpoint, token=TOKEN, cache_dir=hf_cache,
                              local_dir=tmp_path / "local")
    assert _read_tree(local) == held

    single = hf_hub_download(REPO, "model.safetensors", endpoint=hub.endpoint, token=TOKEN,
                             cache_dir=tmp_path / "other_cache")
    assert Path(single).read_bytes() == files["model.safetensors"]


def test_second_commit_and_old_revision(hub: HubServer, hf_cache: Path, tmp_path: Path):
    api, files, first = _create_and_upload(hub, tmp_path)
    new_config = json.dumps({"hidden_size": 16, "layers": 4}).encode()
    second = api.create_commit(
        REPO,
        operations=[CommitOperationAdd("config.json", new_config),
                    CommitOperationDelete("tokenizer.json")],
        commit_message="Update config",
    ).oid
    assert second != first and len(second) == 40
    assert hub.refs(REPO)["main"] == second
    assert hub.commits(REPO)[-1]["parents"] == [first]
    assert hub.commits(REPO)[-1]["added"] == ["config.json"]
    assert hub.commits(REPO)[-1]["deleted"] == ["tokenizer.json"]
    assert hub.files(REPO)["config.json"] == new_config
    assert "tokenizer.json" not in hub.files(REPO)
    assert hub.files(REPO, first)["config.json"] == files["config.json"]
    assert api.model_info(REPO).sha == second

    old = snapshot_download(REPO, revision=first, endpoint=hub.endpoint, token=TOKEN,
                            cache_dir=hf_cache)
    old_files = _read_tree(old)
    assert old_files["config.json"] == files["config.json"]
    assert old_files["tokenizer.json"] == files["tokenizer.json"]
    assert old_files["model.safetensors"] == files["model.safetensors"]
    new = snapshot_download(REPO, endpoint=hub.endpoint, token=TOKEN, cache_dir=hf_cache)
    assert Path(new).name == second
    assert _read_tree(new)["config.json"] == new_config
    assert "tokenizer.json" not in _read_tree(new)
    by_short_sha = hf_hub_download(REPO, "config.json", revision=first[:12],
                                   endpoint=hub.endpoint, token=TOKEN, cache_dir=hf_cache)
    assert Path(by_short_sha).read_bytes() == files["config.json"]

    # Re-uploading identical content is a client-side no-op (preupload reports the remote oid).
    before = len(hub.commits(REPO))
    api.upload_file(path_or_fileobj=new_config, path_in_repo="config.json", repo_id=REPO)
    api.upload_file(path_or_fileobj=files["model.safetensors"], path_in_repo="model.safetensors",
                    repo_id=REPO)
    assert len(hub.commits(REPO)) == before

    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")


def test_wrong_or_missing_token_is_rejected(hub: HubServer, hf_cache: Path, tmp_path: Path):
    api, files, _ = _create_and_upload(hub, tmp_path)
    for token, reason in (("hf_wrong", "Invalid credentials in Authorization header"),
                          (False, "Authorization header is required")):
        bad = HfApi(endpoint=hub.endpoint, token=token)
        with pytest.raises(HfHubHTTPError) as err:
            bad.model_info(REPO)
        assert err.value.response.status_code == 401
        assert reason in str(err.value)
        with pytest.raises(HfHubHTTPError) as err:
            bad.upload_file(path_or_fileobj=b"x", path_in_repo="evil.txt", repo_id=REPO)
        assert err.value.response.status_code == 401
    assert "evil.txt" not in hub.files(REPO)

    with pytest.raises(HfHubHTTPError) as err:
        snapshot_download(REPO, endpoint=hub.endpoint, token="hf_wrong",
                          cache_dir=tmp_path / "bad_cache")
    assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as err:
        hf_hub_download(REPO, "config.json", endpoint=hub.endpoint, token="hf_wrong",
                        cache_dir=tmp_path / "bad_cache")
    assert err.value.response.status_code == 401

    hub.requests.clear()
    assert api.model_info(REPO).sha == hub.refs(REPO)["main"]
    assert hub.requests == [("GET", f"/api/models/{REPO}")]


def test_create_repo_conflicts_and_create_pr(hub: HubServer, hf_cache: Path, tmp_path: Path):
    api, files, main_oid = _create_and_upload(hub, tmp_path)
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO)
    assert err.value.response.status_code == 409
    url = api.create_repo("solo")  # no namespace: goes under the token owner, like the Hub
    assert url.repo_id == f"{HubServer.username}/solo"

    info = api.upload_file(path_or_fileobj=b"# card\n", path_in_repo="README.md", repo_id=REPO,
                           create_pr=True, commit_message="Add card")
    assert info.pr_url == f"{hub.endpoint}/{REPO}/discussions/1"
    assert (info.pr_revision, info.pr_num) == ("refs/pr/1", 1)
    assert hub.refs(REPO) == {"main": main_oid, "refs/pr/1": info.oid}
    assert "README.md" not in hub.files(REPO)
    assert hub.files(REPO, "refs/pr/1")["README.md"] == b"# card\n"
    assert hub.commits(REPO)[-1]["pr_num"] == 1
    assert api.model_info(REPO, revision="refs/pr/1").sha == info.oid
    card = hf_hub_download(REPO, "README.md", revision="refs/pr/1", endpoint=hub.endpoint,
                           token=TOKEN, cache_dir=hf_cache)
    assert Path(card).read_bytes() == b"# card\n"

    second = api.upload_file(path_or_fileobj=b"more", path_in_repo="notes.txt", repo_id=REPO,
                             create_pr=True)
    assert second.pr_num == 2
    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert [r.ref for r in refs.pull_requests] == ["refs/pr/1", "refs/pr/2"]
    assert [b.target_commit for b in refs.branches] == [main_oid]


def test_multipart_lfs_and_tree_paging(hf_cache: Path, tmp_path: Path):
    with HubServer(token=TOKEN, multipart_chunk_size=1024 * 1024, tree_page_size=2) as hub:
        api, files, oid = _create_and_upload(hub, tmp_path)
        puts = [p for m, p in hub.requests if m == "PUT"]
        assert len(puts) == 3  # 3 MiB in 1 MiB parts, then a completion POST
        api.upload_file(path_or_fileobj=b"w", path_in_repo="sub/dir/weights.txt", repo_id=REPO)

        tree = list(api.list_repo_tree(REPO, recursive=True))
        paths = sorted(e.path for e in tree)
        assert paths == sorted([*hub.files(REPO), "sub", "sub/dir"])
        assert sum(p.startswith(f"/api/models/{REPO}/tree/") for _, p in hub.requests) >= 3
        top = sorted(e.path for e in api.list_repo_tree(REPO))
        assert top == sorted([*files, ".gitattributes", "sub"])

        path = snapshot_download(REPO, endpoint=hub.endpoint, token=TOKEN, cache_dir=hf_cache)
        assert _read_tree(path) == hub.files(REPO)


def test_raw_protocol_checks(hub: HubServer, tmp_path: Path):
    api, files, oid = _create_and_upload(hub, tmp_path)
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def call(method: str, url: str, body: bytes | None = None, headers: dict | None = None):
        req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    resolve = f"{hub.endpoint}/{REPO}/resolve/main/model.safetensors"
    status, headers, body = call("GET", resolve, headers={**auth, "Range": "bytes=10-19"})
    assert status == 206 and body == files["model.safetensors"][10:20]
    assert headers["Content-Range"] == f"bytes 10-19/{MODEL_SIZE}"
    status, headers, _ = call("HEAD", resolve, headers=auth)
    assert status == 200 and headers["X-Repo-Commit"] == oid
    assert headers["X-Linked-Size"] == str(MODEL_SIZE)
    assert headers["X-Linked-Etag"].strip('"') == hashlib.sha256(
        files["model.safetensors"]).hexdigest()
    status, headers, _ = call("HEAD", f"{hub.endpoint}/{REPO}/resolve/main/nope.bin",
                              headers=auth)
    assert status == 404 and headers["X-Error-Code"] == "EntryNotFound"
    status, _, _ = call("HEAD", resolve)
    assert status == 401

    # An LFS PUT whose content does not match the announced sha256/size is refused.
    data = b"payload" * 1000
    sha = hashlib.sha256(data).hexdigest()
    batch = json.dumps({"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
                        "objects": [{"oid": sha, "size": len(data)}]}).encode()
    status, _, body = call("POST", f"{hub.endpoint}/{REPO}.git/info/lfs/objects/batch", batch,
                           {**auth, "Content-Type": "application/vnd.git-lfs+json"})
    assert status == 200
    href = json.loads(body)["objects"][0]["actions"]["upload"]["href"]
    assert call("PUT", href, b"x" + data[1:])[0] == 400
    assert call("PUT", href, data[:-1])[0] == 400
    assert call("PUT", href, data)[0] == 200  # no Authorization: presigned-style URL
    verify = json.dumps({"oid": sha, "size": len(data)}).encode()
    verify_url = f"{hub.endpoint}/{REPO}.git/info/lfs/objects/verify"
    assert call("POST", verify_url, verify, auth)[0] == 200
    assert call("POST", verify_url, verify)[0] == 401


def test_client_configured_by_env_vars_only(hub: HubServer, tmp_path: Path):
    """A fresh interpreter configured by HF_ENDPOINT/HF_TOKEN/HF_HUB_DISABLE_XET alone."""
    api, files, oid = _create_and_upload(hub, tmp_path)
    script = (
        "import sys\n"
        "from huggingface_hub import HfApi, hf_hub_download\n"
        "api = HfApi()\n"
        "api.upload_file(path_or_fileobj=b'x' * 2_000_000, path_in_repo='extra.bin',"
        f" repo_id={REPO!r})\n"
        f"p = hf_hub_download({REPO!r}, 'model.safetensors')\n"
        "sys.stdout.write(open(p, 'rb').read().hex()[:64])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1",
               HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "child_home"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode() == files["model.safetensors"][:32].hex()
    assert hub.files(REPO)["extra.bin"] == b"x" * 2_000_000
    assert hub.commits(REPO)[-1]["lfs"] == ["extra.bin"]
    assert hub.commits(REPO)[-1]["parents"] == [oid]


def test_replacing_commit_listing_at_a_revision_and_stale_parent(hub: HubServer, hf_cache: Path,
                                                                  tmp_path: Path):
    """What a push that replaces weights relies on: the file list at a revision, LFS files
    deleted in the commit that adds their replacement, and ``parent_commit`` refused (412)
    once the branch moved; a refused commit changes nothing."""
    api, files, first = _create_and_upload(hub, tmp_path)
    info = api.model_info(REPO, revision="main")
    assert info.sha == first
    assert sorted(s.rfilename for s in info.siblings) == sorted([*files, ".gitattributes"])
    shard = os.urandom(1024)
    second = api.create_commit(
        REPO, [CommitOperationAdd("model-00001-of-00001.safetensors", shard),
               CommitOperationDelete("model.safetensors")],
        commit_message="Replace weights", parent_commit=first).oid
    last = hub.commits(REPO)[-1]
    assert (last["added"], last["deleted"]) == (["model-00001-of-00001.safetensors"],
                                                ["model.safetensors"])
    assert last["lfs"] == ["model-00001-of-00001.safetensors"]
    assert "model.safetensors" not in api.list_repo_files(REPO)
    assert "model.safetensors" in api.list_repo_files(REPO, revision=first)
    assert "model.safetensors" in {s.rfilename for s in api.model_info(REPO, revision=first)
                                   .siblings}
    new = _read_tree(snapshot_download(REPO, endpoint=hub.endpoint, token=TOKEN,
                                       cache_dir=hf_cache))
    assert "model.safetensors" not in new
    assert new["model-00001-of-00001.safetensors"] == shard

    with pytest.raises(HfHubHTTPError) as err:  # the branch moved on since ``first``
        api.create_commit(REPO, [CommitOperationDelete("config.json")],
                          commit_message="Stale", parent_commit=first)
    assert err.value.response.status_code == 412
    with pytest.raises(HfHubHTTPError) as err:
        api.create_commit(REPO, [CommitOperationAdd("a.txt", b"a"),
                                 CommitOperationDelete("no-such.safetensors")],
                          commit_message="Missing", parent_commit=second)
    assert err.value.response.status_code == 404
    assert err.value.response.headers["X-Error-Code"] == "EntryNotFound"
    assert hub.refs(REPO)["main"] == second and "a.txt" not in hub.files(REPO)


def test_per_file_limit_and_operations_per_commit(hf_cache: Path, tmp_path: Path):
    """The Hub's limits, set low: an LFS object above ``max_file_size`` gets a per-object
    error in the batch answer (no upload URL), and a commit of more than
    ``max_commit_operations`` operations is refused with 422, changing nothing."""
    with HubServer(token=TOKEN, max_file_size=MODEL_SIZE - 1, max_commit_operations=2) as hub:
        api = HfApi(endpoint=hub.endpoint, token=TOKEN)
        api.create_repo(REPO)
        files = _export_folder(tmp_path / "export")
        with pytest.raises(ValueError, match="File too large") as err:
            api.upload_folder(repo_id=REPO, folder_path=tmp_path / "export")
        assert str(MODEL_SIZE) in str(err.value)
        assert hub.lfs_uploads() == 0 and hub.lfs_objects(REPO) == {}
        assert [c["title"] for c in hub.commits(REPO)] == ["initial commit"]

        small = [CommitOperationAdd(name, files[name]) for name in ("config.json",
                                                                    "tokenizer.json")]
        with pytest.raises(HfHubHTTPError) as err:
            api.create_commit(REPO, [*small, CommitOperationAdd("c.txt", b"c")],
                              commit_message="three")
        assert err.value.response.status_code == 422
        assert "Too many operations in one commit: 3, at most 2" in str(err.value)
        assert set(hub.files(REPO)) == {".gitattributes"}
        api.create_commit(REPO, small, commit_message="two")
        assert set(hub.files(REPO)) == {".gitattributes", "config.json", "tokenizer.json"}


def test_held_lfs_uploads_are_dropped_on_release(hub: HubServer):
    """``hold_lfs_uploads(after=1)``: one object is stored, the next upload waits
    unanswered; released, it is dropped (connection closed, nothing stored), and the
    uploads after the release go through."""
    import http.client
    import threading

    HfApi(endpoint=hub.endpoint, token=TOKEN).create_repo(REPO)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/vnd.git-lfs+json"}
    blobs = [os.urandom(4096) for _ in range(3)]
    sha = [hashlib.sha256(b).hexdigest() for b in blobs]
    batch = json.dumps({"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
                        "objects": [{"oid": o, "size": 4096} for o in sha]}).encode()
    req = urllib.request.Request(f"{hub.endpoint}/{REPO}.git/info/lfs/objects/batch", batch,
                                 auth, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        hrefs = [o["actions"]["upload"]["href"] for o in json.loads(resp.read())["objects"]]

    def put(i: int) -> int:
        put_req = urllib.request.Request(hrefs[i], blobs[i], method="PUT")
        with urllib.request.urlopen(put_req, timeout=30) as resp:
            return resp.status

    hub.hold_lfs_uploads(after=1)
    assert put(0) == 200
    outcome: list[BaseException | int] = []
    thread = threading.Thread(target=lambda: outcome.append(_catch(put, 1)))
    thread.start()
    for _ in range(400):
        if hub.held_lfs_uploads:
            break
        thread.join(0.05)
    assert hub.held_lfs_uploads == 1 and thread.is_alive() and sha[1] not in hub.lfs_objects(REPO)
    hub.release_lfs_uploads()
    thread.join(30)
    assert not thread.is_alive() and hub.held_lfs_uploads == 0
    assert isinstance(outcome[0], (http.client.RemoteDisconnected, ConnectionError))
    assert put(2) == 200
    assert set(hub.lfs_objects(REPO)) == {sha[0], sha[2]}
    assert hub.lfs_uploads() == 3  # received: stored, dropped, stored


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        return exc
