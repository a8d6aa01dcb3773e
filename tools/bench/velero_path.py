#!/usr/bin/env python3
"""Case 9 of scripts/bench.sh: the agent against Velero 1.18's own file-system data path.

Both sides back up and restore the same volumes into the same kind of repository, driven the
way Velero drives them, on one real kube-apiserver:

- agent: `podvolume-agent run` (release build, its kopia CLI child), one process for the whole
  case, serving PodVolumeBackups/PodVolumeRestores made as Velero's server makes them. Its time is
  from creating the object to seeing it Completed (a watch on the API).
- Velero: `velero pod-volume backup|restore`, the command Velero 1.17+'s data-path pods run
  (Velero's kopia library in-process), as a host process (tools/velero-smoke/velero-data-path.sh)
  on an object its node agent has set InProgress. Its time is the process's life; the pod's
  scheduling and start, and Velero's node agent, are not counted.

Both use one BackupStorageLocation per store: Velero's filesystem backend (`velero.io/fs`) or
the S3 server (gofakes3 on the work disk, TLS: tools/bench/s3-server). The kopia repository of each run's namespace is made beforehand with
the kopia CLI and Velero's password; the BackupRepository says Ready (no Velero server runs).

Measured per operation: wall; CPU (user+system of everything the side ran: the agent's own
counters plus its waited-for kopia children; the Velero process tree's rusage); peak RSS (the sum
of VmRSS over the side's processes, sampled every 20 ms: agent + kopia, velero); bytes read
from disk (read_bytes, which includes waited-for children).

Cold: the page cache dropped (`echo 3 > /proc/sys/vm/drop_caches`, root only) and no kopia cache
for the repository; warm: the data just read and the side's kopia cache kept.
"""

import argparse
import base64
import hashlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET

PASSWORD = "static-passw0rd"  # Velero's repository password (Secret velero-repo-credentials)
VNS = "velero"
NODE = "bench-node"
# Velero's side runs on a node of its own: the agent takes every new object of its node.
VELERO_NODE = "velero-node"
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --- a minimal API client (admin client certificate) ----------------------------------------------


class Api:
    def __init__(self, url, pki):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port
        self.ctx = ssl.create_default_context(cafile=os.path.join(pki, "ca.crt"))
        self.ctx.load_cert_chain(os.path.join(pki, "admin.crt"), os.path.join(pki, "admin.key"))

    def conn(self, timeout=60):
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=timeout)

    def req(self, method, path, body=None, ctype="application/json", ok=(200, 201)):
        c = self.conn()
        try:
            data = json.dumps(body).encode() if body is not None else None
            c.request(method, path, body=data, headers={"Content-Type": ctype} if data else {})
            r = c.getresponse()
            raw = r.read()
        finally:
            c.close()
        if r.status not in ok:
            raise RuntimeError(f"{method} {path}: {r.status} {raw[:300]!r}")
        return json.loads(raw) if raw else {}

    def create(self, coll, obj):
        return self.req("POST", coll, obj)

    def get(self, path):
        return self.req("GET", path)

    def patch_status(self, path, status):
        """Through the status subresource where the CRD has one, else on the object (as Velero's
        CRDs without one are written)."""
        body, merge = {"status": status}, "application/merge-patch+json"
        try:
            return self.req("PATCH", path + "/status", body, merge)
        except RuntimeError as e:
            if ": 404 " not in str(e):
                raise
            return self.req("PATCH", path, body, merge)

    def watch_until(self, coll, name, done, timeout):
        """Watches `name` in collection `coll` until done(obj) is true; returns (obj, when)."""
        deadline = time.monotonic() + timeout
        while True:
            lst = self.get(f"{coll}?fieldSelector=metadata.name%3D{name}")
            for o in lst.get("items", []):
                if done(o):
                    return o, time.monotonic()
            rv = lst["metadata"]["resourceVersion"]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{coll}/{name} not done within {timeout} s")
            c = self.conn(timeout=min(left, 30) + 5)
            try:
                c.request("GET", f"{coll}?watch=1&fieldSelector=metadata.name%3D{name}"
                          f"&resourceVersion={rv}&timeoutSeconds={int(min(left, 30)) + 1}")
                r = c.getresponse()
                while True:
                    line = r.readline()
                    if not line:
                        break
                    ev = json.loads(line)
                    if ev.get("type") in ("ADDED", "MODIFIED") and done(ev["object"]):
                        return ev["object"], time.monotonic()
            except (socket.timeout, TimeoutError, http.client.HTTPException):
                pass
            finally:
                c.close()


# --- /proc measurement ----------------------------------------------------------------------------


def proc_stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rest = s[s.rindex(")") + 2:].split()
    return rest  # rest[0] is state (field 3)


def cpu_ticks(pid, children=True):
    r = proc_stat(pid)
    t = int(r[11]) + int(r[12])  # utime, stime (fields 14, 15)
    if children:
        t += int(r[13]) + int(r[14])  # cutime, cstime: waited-for children
    return t


def read_bytes(pid):
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE // 1024
    except (OSError, IndexError):
        return 0


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


class RssSampler:
    """Peak of the summed RSS of `root`'s process tree (processes whose name is in `names`)."""

    def __init__(self, root, names):
        self.root, self.names = root, names
        self.peak = self.uploader_peak = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            total = up = 0
            for p in descendants(self.root):
                c = comm(p)
                if c in self.names:
                    r = rss_kib(p)
                    total += r
                    if c in ("kopia", "velero"):
                        up += r
            self.peak = max(self.peak, total)
            self.uploader_peak = max(self.uploader_peak, up)
            self.stop.wait(0.02)

    def finish(self):
        self.stop.set()
        self.t.join()
        return self.peak / 1024, self.uploader_peak / 1024


def drop_caches(cold):
    os.sync()
    if cold:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False
    return True


# --- data shapes ----------------------------------------------------------------------------------


def write_random(path, size, rng):
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, 8 << 20)
            f.write(rng.randbytes(n))
            left -= n


def gen_small_tree(root, count, rng, max_size=16 << 10, fanout=12, depth=4):
    """`count` files of 0..max_size bytes, spread over a tree `depth` directories deep."""
    total = 0
    for i in range(count):
        parts = []
        x = i // 40
        for _ in range(depth):
            parts.append(f"d{x % fanout:02}")
            x //= fanout
        d = os.path.join(root, *parts)
        os.makedirs(d, exist_ok=True)
        n = rng.randrange(max_size + 1)
        with open(os.path.join(d, f"f{i:06}.dat"), "wb") as f:
            f.write(rng.randbytes(n))
        total += n
    return total


def make_shape(name, root, sizes, seed):
    rng = random.Random(seed)
    os.makedirs(root)
    if name == "large":
        write_random(os.path.join(root, "disk.img"), sizes["large"], rng)
        return f"one {sizes['large'] >> 20} MiB file"
    if name == "small":
        gen_small_tree(root, sizes["small"], rng)
        return f"{sizes['small']:,} files of 0-16 KiB, 4 directories deep"
    if name == "mixed":
        big, n = sizes["mixed_large"], sizes["mixed_small"]
        for i in range(3):
            write_random(os.path.join(root, f"big-{i}.bin"), big, rng)
        # A sparse file: holes between random extents (what sparse restores are about).
        sparse = os.path.join(root, "vm.img")
        with open(sparse, "wb") as f:
            f.truncate(big * 2)
            for k in range(0, big * 2, big // 2):
                f.seek(k)
                f.write(rng.randbytes(1 << 20))
        gen_small_tree(os.path.join(root, "tree"), n, rng)
        return (f"3 files of {big >> 20} MiB, a {2 * big >> 20} MiB sparse file "
                f"({2 * big // (big // 2)} MiB allocated), {n:,} small files")
    raise ValueError(name)


def shape_bytes(name, sizes):
    """What a shape's files hold, in bytes (allocated; small files counted at their 8 KiB mean
    plus a 4 KiB block of slack each)."""
    small = lambda n: n * (12 << 10)
    if name == "large":
        return sizes["large"]
    if name == "small":
        return small(sizes["small"])
    if name == "mixed":
        return 3 * sizes["mixed_large"] + 4 * (1 << 20) + small(sizes["mixed_small"])
    raise ValueError(name)


# Kopia's caches of one side at most (its content cache soft limit at Velero's default
# cacheLimitMB 5000 is 3.2 GB, the metadata cache takes the rest).
KOPIA_CACHE_BYTES = 5000 << 20


def check_free_space(work, shape_sizes):
    """Fails before anything runs when the work disk cannot hold the biggest shape's run: its
    data, the two repositories of the side that runs (the S3 server's objects are on this disk
    too), one restored copy and that side's kopia caches, with 2 GiB to spare. A run that fills
    the disk fails an hour in with ENOSPC from kopia; this says so in the first second."""
    biggest = max(shape_sizes)
    need = 4 * biggest + min(biggest, KOPIA_CACHE_BYTES) + (2 << 30)
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"velero_path.py: {work} has {free / 2**30:.1f} GiB free; this run needs about "
                         f"{need / 2**30:.1f} GiB (data, two repositories, a restored copy and a kopia cache "
                         f"of its biggest shape, {biggest / 2**30:.1f} GiB). Free some, or set BENCH_WORK_PARENT "
                         f"to a bigger disk.")


def tree_digest(root, skip=".velero"):
    """(files, bytes, sha256 of every path and content) of a tree."""
    h = hashlib.sha256()
    files = size = 0
    for d, dirs, fs in os.walk(root):
        dirs.sort()
        if d == root and skip in dirs:
            dirs.remove(skip)
        for name in sorted(fs):
            p = os.path.join(d, name)
            h.update(os.path.relpath(p, root).encode() + b"\0")
            with open(p, "rb") as f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        break
                    h.update(b)
            files += 1
            size += os.path.getsize(p)
    return files, size, h.hexdigest()


def tree_summary(root, skip=".velero"):
    files = size = 0
    for d, dirs, fs in os.walk(root):
        if d == root and skip in dirs:
            dirs.remove(skip)
        for name in fs:
            files += 1
            size += os.lstat(os.path.join(d, name)).st_size
    return files, size


# --- the bed --------------------------------------------------------------------------------------


class Bed:
    def __init__(self, a):
        self.a = a
        self.work = a.work
        self.procs = []
        self.pods_dir = os.path.join(self.work, "pods")
        os.makedirs(self.pods_dir, exist_ok=True)
        self.cp_dir = None

    def setup(self):
        """Starts everything; `stop` ends what was started, also after a failure here."""
        a = self.a
        cp_dir = os.path.join(self.work, "cp")
        self.cp_dir = cp_dir
        env = dict(os.environ, CONTROL_PLANE_BIN=a.cp_bin)
        out = subprocess.run([os.path.join(a.root, "scripts/start-control-plane.sh"), cp_dir],
                             env=env, stdout=subprocess.PIPE, stderr=open(os.path.join(self.work, "cp.log"), "w"),
                             text=True)
        if out.returncode != 0:
            raise RuntimeError("the control plane did not start (see cp.log)")
        self.cp_dir = cp_dir
        vals = dict(l.split("=", 1) for l in out.stdout.splitlines() if "=" in l)
        self.kubeconfig = vals["KUBECONFIG"]
        self.api = Api(vals["APISERVER_URL"], os.path.join(cp_dir, "pki"))
        self.kubectl(["apply", "-f", a.crds])
        self.kubectl(["wait", "--for=condition=established", "--timeout=60s",
                      "crd/podvolumebackups.velero.io", "crd/podvolumerestores.velero.io",
                      "crd/backuprepositories.velero.io", "crd/backupstoragelocations.velero.io"])
        self.api.create("/api/v1/namespaces", {"metadata": {"name": VNS}})
        for n in (NODE, VELERO_NODE):
            self.api.create("/api/v1/nodes", {"metadata": {"name": n, "labels": {"kubernetes.io/hostname": n}}})
        self.api.create(f"/api/v1/namespaces/{VNS}/secrets", {
            "metadata": {"name": "velero-repo-credentials"}, "stringData": {"repository-password": PASSWORD}})
        self.backup = self.api.create(f"/apis/velero.io/v1/namespaces/{VNS}/backups", {
            "apiVersion": "velero.io/v1", "kind": "Backup", "metadata": {"name": "bench"},
            "spec": {"storageLocation": "fs"}, "status": {"phase": "InProgress"}})
        self.restore = self.api.create(f"/apis/velero.io/v1/namespaces/{VNS}/restores", {
            "apiVersion": "velero.io/v1", "kind": "Restore", "metadata": {"name": "bench"},
            "spec": {"backupName": "bench"}, "status": {"phase": "InProgress"}})
        self.stores = {}
        fs_root = os.path.join(self.work, "fs-store")
        os.makedirs(fs_root)
        self.stores["fs"] = {"spec": {"provider": "velero.io/fs", "objectStorage": {"bucket": "bench", "prefix": "fs"},
                                      "config": {"fspath": fs_root}},
                             "kopia": lambda ns: ["filesystem", f"--path={fs_root}/fs/kopia/{ns}"],
                             "what": "Velero's filesystem backend (velero.io/fs) on the work disk"}
        self.creds = os.path.join(self.work, "cloud")
        if "s3" in a.stores:
            self.start_s3()
        for name, s in self.stores.items():
            self.api.create(f"/apis/velero.io/v1/namespaces/{VNS}/backupstoragelocations", {
                "apiVersion": "velero.io/v1", "kind": "BackupStorageLocation",
                "metadata": {"name": name}, "spec": s["spec"]})
        self.start_agent()
        self.n = 0

    def kubectl(self, args):
        subprocess.run([os.path.join(self.a.cp_bin, "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                       check=True, stdout=subprocess.DEVNULL)

    def start_s3(self):
        d = os.path.join(self.work, "s3")
        os.makedirs(d)
        sh = lambda *c: subprocess.run(list(c), cwd=d, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", "ca.key", "-out", "ca.pem",
           "-subj", "/CN=bench CA", "-addext", "basicConstraints=critical,CA:TRUE",
           "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
           "-subj", "/CN=127.0.0.1")
        with open(os.path.join(d, "server.ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
        sh("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
           "-days", "2", "-out", "server.pem", "-extfile", "server.ext")
        p = subprocess.Popen([self.a.s3_server, "-dir", os.path.join(d, "objects"), "-cert", "server.pem",
                              "-key", "server.key", "-bucket", "bench", "-stats"],
                             cwd=d, stdout=subprocess.PIPE, stderr=open(os.path.join(d, "s3-server.log"), "w"),
                             text=True, start_new_session=True)
        self.procs.append(p)
        line = p.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the S3 server did not start (see {d}/s3-server.log)")
        port = int(line.split()[2])
        self.s3_proc = p
        url = f"https://127.0.0.1:{port}"
        self.s3_url = url
        # The server checks no signature; the keys only have to look like keys to both sides.
        k = {"accessKeyId": "AKIABENCHVELERO00000", "secretAccessKey": "bench-secret-key-of-forty-characters-000"}
        with open(self.creds, "w") as f:
            f.write(f"[default]\naws_access_key_id = {k['accessKeyId']}\naws_secret_access_key = {k['secretAccessKey']}\n")
        os.chmod(self.creds, 0o600)
        self.s3_keys = k
        ca = open(os.path.join(d, "ca.pem"), "rb").read()
        self.s3_ca = os.path.join(d, "ca.pem")
        self.stores["s3"] = {"spec": {"provider": "aws", "objectStorage": {"bucket": "bench", "prefix": "s3",
                                                                          "caCert": base64.b64encode(ca).decode()},
                                      "config": {"region": "us-east-1", "s3Url": url}},
                             "kopia": lambda ns: ["s3", "--endpoint=127.0.0.1:%d" % port, "--bucket=bench",
                                                  f"--prefix=s3/kopia/{ns}/", "--region=us-east-1",
                                                  f"--root-ca-pem-path={self.s3_ca}"],
                             "what": "gofakes3's S3 server (tools/bench/s3-server, objects on the work disk) "
                                     "over TLS on loopback"}

    def start_agent(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        self.scratch = os.path.join(self.work, "scratch")
        os.makedirs(self.scratch)
        argv = [self.a.agent, "run", f"--kubeconfig={self.kubeconfig}", f"--node-name={NODE}", f"--namespace={VNS}",
                f"--host-pods-dir={self.pods_dir}", f"--scratch-dir={self.scratch}",
                f"--state-dir={os.path.join(self.work, 'state')}", f"--kopia-binary={self.a.kopia}",
                f"--listen-address=127.0.0.1:{port}", "--log-format=plain",
                f"--default-credentials-file={self.creds}", *self.a.agent_arg]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KOPIA_", "PODVOLUME_", "AWS_"))}
        env["RUST_LOG"] = os.environ.get("BENCH_AGENT_LOG", "warn")
        self.agent = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                      stdout=open(os.path.join(self.work, "agent.log"), "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.procs.append(self.agent)
        deadline = time.monotonic() + 60
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/readyz")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if self.agent.poll() is not None or time.monotonic() > deadline:
                tail = open(os.path.join(self.work, "agent.log")).read()[-2000:]
                raise RuntimeError(f"the agent did not become ready; its log ends:\n{tail}")
            time.sleep(0.2)

    def stop(self):
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, 15)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
        if self.cp_dir:
            subprocess.run([os.path.join(self.a.root, "scripts/start-control-plane.sh"), "--stop", self.cp_dir],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    # --- per run: a namespace, its repository, its pods ---

    def namespace(self, store):
        """A fresh namespace (so a fresh, empty repository of `store`) with a Ready BackupRepository."""
        self.n += 1
        ns = f"run-{self.n:03}"
        self.api.create("/api/v1/namespaces", {"metadata": {"name": ns}})
        cfg = os.path.join(self.work, "kopia-init", ns)
        env = dict(os.environ, KOPIA_PASSWORD=PASSWORD, KOPIA_CONFIG_PATH=os.path.join(cfg, "repository.config"),
                   KOPIA_LOG_DIR=os.path.join(cfg, "logs"), KOPIA_CHECK_FOR_UPDATES="false",
                   KOPIA_PERSIST_CREDENTIALS_ON_CONNECT="false", KOPIA_USE_KEYRING="false")
        if store == "s3":
            env.update(AWS_ACCESS_KEY_ID=self.s3_keys["accessKeyId"], AWS_SECRET_ACCESS_KEY=self.s3_keys["secretAccessKey"])
        subprocess.run([self.a.kopia, "repository", "create", *self.stores[store]["kopia"](ns),
                        f"--cache-directory={os.path.join(cfg, 'cache')}", "--no-auto-maintenance"],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        shutil.rmtree(cfg)
        name = f"{ns}-{store}-kopia"
        self.api.create(f"/apis/velero.io/v1/namespaces/{VNS}/backuprepositories", {
            "apiVersion": "velero.io/v1", "kind": "BackupRepository",
            "metadata": {"name": name, "labels": {"velero.io/volume-namespace": ns, "velero.io/storage-location": store,
                                                   "velero.io/repository-type": "kopia"}},
            "spec": {"volumeNamespace": ns, "backupStorageLocation": store, "repositoryType": "kopia",
                     "resticIdentifier": "", "maintenanceFrequency": "1h"}})
        self.api.patch_status(f"/apis/velero.io/v1/namespaces/{VNS}/backuprepositories/{name}", {"phase": "Ready"})
        return ns

    def store_requests(self):
        """The S3 server's counts since the last call (connections, GETs, ranged GETs, PUTs...),
        and resets them: what one transfer asked of the store. Empty without the S3 server."""
        p = getattr(self, "s3_proc", None)
        if p is None or p.poll() is not None:
            return {}
        os.kill(p.pid, signal.SIGUSR1)
        line = p.stdout.readline().split()
        if not line or line[0] != "stats":
            raise RuntimeError(f"the S3 server answered SIGUSR1 with {' '.join(line)!r}, not its counts")
        return {k: int(v) for k, v in (f.split("=", 1) for f in line[1:])}

    def drop_repositories(self, store, namespaces):
        if store == "fs":
            for ns in namespaces:
                shutil.rmtree(os.path.join(self.work, "fs-store", "fs", "kopia", ns))
            return
        # Through the S3 API (list, then delete each object), as a user would empty a prefix.
        ctx = ssl.create_default_context(cafile=self.s3_ca)
        host = urllib.parse.urlsplit(self.s3_url)
        c = http.client.HTTPSConnection(host.hostname, host.port, context=ctx, timeout=120)
        for ns in namespaces:
            while True:
                q = urllib.parse.urlencode({"list-type": "2", "prefix": f"s3/kopia/{ns}/", "max-keys": "1000"})
                c.request("GET", f"/bench?{q}")
                r = c.getresponse()
                body = r.read()
                if r.status != 200:
                    raise RuntimeError(f"listing s3/kopia/{ns}/: HTTP {r.status}: {body[:200]!r}")
                keys = [e.text for e in ET.fromstring(body).iter() if e.tag.endswith("}Key") or e.tag == "Key"]
                if not keys:
                    break
                for key in keys:
                    c.request("DELETE", "/bench/" + urllib.parse.quote(key))
                    r = c.getresponse()
                    r.read()
                    if r.status not in (200, 204):
                        raise RuntimeError(f"deleting {key}: HTTP {r.status}")
        c.close()

    def open_floor(self, store):
        """Peak RSS (MiB) of `kopia repository status` on a fresh repository of `store`: what one
        open costs (the key derived with scrypt), with and without GOMEMLIMIT=32MiB."""
        ns = self.namespace(store)
        cfg = os.path.join(self.work, "kopia-floor")
        env = dict(os.environ, KOPIA_PASSWORD=PASSWORD, KOPIA_CONFIG_PATH=os.path.join(cfg, "repository.config"),
                   KOPIA_LOG_DIR=os.path.join(cfg, "logs"), KOPIA_CHECK_FOR_UPDATES="false",
                   KOPIA_PERSIST_CREDENTIALS_ON_CONNECT="false", KOPIA_USE_KEYRING="false")
        if store == "s3":
            env.update(AWS_ACCESS_KEY_ID=self.s3_keys["accessKeyId"], AWS_SECRET_ACCESS_KEY=self.s3_keys["secretAccessKey"])
        subprocess.run([self.a.kopia, "repository", "connect", *self.stores[store]["kopia"](ns),
                        f"--cache-directory={os.path.join(cfg, 'cache')}"], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = []
        for extra in ({}, {"GOMEMLIMIT": "32MiB"}):
            p = subprocess.Popen([self.a.kopia, "repository", "status"], env=dict(env, **extra),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _, status, ru = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            out.append(ru.ru_maxrss / 1024)
        shutil.rmtree(cfg)
        self.drop_repositories(store, [ns])
        return out

    def pod(self, ns, name, restore=False, node=NODE):
        spec = {"nodeName": node, "containers": [{"name": "app", "image": "busybox"}],
                "volumes": [{"name": "data", "emptyDir": {}}]}
        if restore:
            spec["initContainers"] = [{"name": "restore-wait", "image": "velero/velero"}]
        pod = self.api.create(f"/api/v1/namespaces/{ns}/pods", {"metadata": {"name": name}, "spec": spec})
        if restore:
            self.api.patch_status(f"/api/v1/namespaces/{ns}/pods/{name}", {
                "phase": "Pending", "initContainerStatuses": [{
                    "name": "restore-wait", "image": "velero/velero", "imageID": "", "ready": False, "restartCount": 0,
                    "state": {"running": {"startedAt": "2026-12-07T00:00:00Z"}}}]})
        d = os.path.join(self.pods_dir, pod["metadata"]["uid"], "volumes", "kubernetes.io~empty-dir", "data")
        return pod, d

    def pvb(self, name, ns, pod, store, node=NODE):
        b = self.backup["metadata"]
        pm = pod["metadata"]
        o = {"apiVersion": "velero.io/v1", "kind": "PodVolumeBackup",
             "metadata": {"name": name, "labels": {"velero.io/backup-name": b["name"], "velero.io/backup-uid": b["uid"]},
                          "ownerReferences": [{"apiVersion": "velero.io/v1", "kind": "Backup", "name": b["name"],
                                               "uid": b["uid"], "controller": True}]},
             "spec": {"node": node, "pod": {"kind": "Pod", "namespace": ns, "name": pm["name"], "uid": pm["uid"]},
                      "volume": "data", "backupStorageLocation": store, "repoIdentifier": "", "uploaderType": "kopia",
                      "tags": {"backup": b["name"], "backup-uid": b["uid"], "ns": ns, "pod": pm["name"],
                               "pod-uid": pm["uid"], "volume": "data"}}}
        return self.api.create(f"/apis/velero.io/v1/namespaces/{VNS}/podvolumebackups", o)

    def pvr(self, name, ns, pod, store, snapshot, sparse):
        r = self.restore["metadata"]
        pm = pod["metadata"]
        o = {"apiVersion": "velero.io/v1", "kind": "PodVolumeRestore",
             "metadata": {"name": name, "labels": {"velero.io/restore-name": r["name"], "velero.io/restore-uid": r["uid"]},
                          "ownerReferences": [{"apiVersion": "velero.io/v1", "kind": "Restore", "name": r["name"],
                                               "uid": r["uid"], "controller": True}]},
             "spec": {"pod": {"kind": "Pod", "namespace": ns, "name": pm["name"], "uid": pm["uid"]},
                      "volume": "data", "backupStorageLocation": store, "repoIdentifier": "", "uploaderType": "kopia",
                      "snapshotID": snapshot, "sourceNamespace": ns,
                      "uploaderSettings": {"WriteSparseFiles": "true" if sparse else "false"}}}
        return self.api.create(f"/apis/velero.io/v1/namespaces/{VNS}/podvolumerestores", o)


# --- the two sides ---------------------------------------------------------------------------------


def ended(o):
    return (o.get("status") or {}).get("phase") in ("Completed", "Failed", "Canceled")


class Agent:
    name = "agent"

    def __init__(self, bed):
        self.bed = bed

    def _measure(self, create, coll, name):
        pid = self.bed.agent.pid
        cpu0, io0 = cpu_ticks(pid), read_bytes(pid)
        sampler = RssSampler(pid, {"podvolume-agent", "kopia"})
        t0 = time.monotonic()
        create()
        o, t1 = self.bed.api.watch_until(coll, name, ended, self.bed.a.timeout)
        # The kopia child is reaped before the terminal write; its counters are then the agent's.
        peak, up = sampler.finish()
        st = o["status"]
        if st.get("phase") != "Completed":
            raise RuntimeError(f"agent: {name} {st.get('phase')}: {st.get('message')}")
        return {"wall": t1 - t0, "cpu": (cpu_ticks(pid) - cpu0) / TICK, "rss": peak, "uploader_rss": up,
                "read": read_bytes(pid) - io0}, st

    def backup(self, ns, store, data, home):
        pod, d = self.bed.pod(ns, f"src-{self.bed.n}-{time.monotonic_ns() % 10**9}")
        os.makedirs(os.path.dirname(d), exist_ok=True)
        subprocess.run(["cp", "-al", data, d], check=True)
        name = f"a-{ns}-{time.monotonic_ns() % 10**9}"
        m, st = self._measure(lambda: self.bed.pvb(name, ns, pod, store), f"/apis/velero.io/v1/namespaces/{VNS}/podvolumebackups", name)
        return m, st["snapshotID"], pod, d

    def backup_again(self, ns, store, pod, vol, home):
        name = f"a-{ns}-{time.monotonic_ns() % 10**9}"
        m, st = self._measure(lambda: self.bed.pvb(name, ns, pod, store), f"/apis/velero.io/v1/namespaces/{VNS}/podvolumebackups", name)
        return m, st["snapshotID"]

    def forget_cache(self, ns, home):
        # The agent keeps one kopia cache per repository in its scratch directory; between
        # transfers nothing runs, so removing them makes the next transfer's cache cold.
        for e in os.listdir(self.bed.scratch):
            shutil.rmtree(os.path.join(self.bed.scratch, e), ignore_errors=True)

    def restore(self, ns, store, snapshot, sparse, home):
        pod, d = self.bed.pod(ns, f"dst-{time.monotonic_ns() % 10**9}", restore=True)
        os.makedirs(d)
        name = f"a-{ns}-{time.monotonic_ns() % 10**9}"
        m, _ = self._measure(lambda: self.bed.pvr(name, ns, pod, store, snapshot, sparse),
                             f"/apis/velero.io/v1/namespaces/{VNS}/podvolumerestores", name)
        return m, d


class Velero:
    name = "velero"

    def __init__(self, bed):
        self.bed = bed
        self.script = os.path.join(bed.a.root, "tools/velero-smoke/velero-data-path.sh")

    def _run(self, kind, obj_name, volume, home):
        work = os.path.join(self.bed.work, "vdp", obj_name)
        os.makedirs(os.path.join(work, "tmp"), exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KOPIA_", "AWS_"))}
        env.update(NODE_NAME=VELERO_NODE, VELERO_NAMESPACE=VNS, TMPDIR=os.path.join(work, "tmp"), HOME=home,
                   AWS_SHARED_CREDENTIALS_FILE=self.bed.creds)
        argv = [self.script, work, self.bed.a.velero, kind, obj_name, volume, "--",
                "--kubeconfig", self.bed.kubeconfig, "--namespace", VNS]
        if kind == "restore":
            # Its kopia cache for restores (the data-path pod's cache volume): kept per home.
            env["VDP_CACHE_VOLUME"] = os.path.join(home, "restore-cache")
            os.makedirs(env["VDP_CACHE_VOLUME"], exist_ok=True)
        logf = open(os.path.join(work, "log"), "w")
        t0 = time.monotonic()
        p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True)
        sampler = RssSampler(p.pid, {"velero"})
        _, status, ru = os.wait4(p.pid, 0)
        t1 = time.monotonic()
        p.returncode = os.waitstatus_to_exitcode(status)
        peak, up = sampler.finish()
        msg = ""
        try:
            msg = open(os.path.join(work, "termination-log")).read()
        except OSError:
            pass
        if p.returncode != 0:
            raise RuntimeError(f"velero pod-volume {kind} {obj_name} exited {p.returncode}: {msg[:300]} "
                               f"(log {work}/log)")
        m = {"wall": t1 - t0, "cpu": ru.ru_utime + ru.ru_stime, "rss": peak, "uploader_rss": up,
             "read": ru.ru_inblock * 512}
        return m, msg

    def backup(self, ns, store, data, home):
        pod, _ = self.bed.pod(ns, f"vsrc-{time.monotonic_ns() % 10**9}", node=VELERO_NODE)
        return self._backup(ns, store, pod, data, home) + (pod, data)

    def _backup(self, ns, store, pod, data, home):
        name = f"v-{ns}-{time.monotonic_ns() % 10**9}"
        self.bed.pvb(name, ns, pod, store, node=VELERO_NODE)
        self.bed.api.patch_status(f"/apis/velero.io/v1/namespaces/{VNS}/podvolumebackups/{name}", {"phase": "InProgress"})
        m, msg = self._run("backup", name, data, home)
        sid = json.loads(msg).get("snapshotID", "")
        if not sid:
            raise RuntimeError(f"velero backup {name}: no snapshot ID in {msg[:300]!r}")
        return m, sid

    def backup_again(self, ns, store, pod, vol, home):
        return self._backup(ns, store, pod, vol, home)

    def forget_cache(self, ns, home):
        shutil.rmtree(home, ignore_errors=True)
        os.makedirs(home)

    def restore(self, ns, store, snapshot, sparse, home):
        pod, _ = self.bed.pod(ns, f"vdst-{time.monotonic_ns() % 10**9}", node=VELERO_NODE)
        d = os.path.join(self.bed.work, "vrestore", f"{ns}-{time.monotonic_ns() % 10**9}")
        os.makedirs(d)
        name = f"v-{ns}-{time.monotonic_ns() % 10**9}"
        self.bed.pvr(name, ns, pod, store, snapshot, sparse)
        self.bed.api.patch_status(f"/apis/velero.io/v1/namespaces/{VNS}/podvolumerestores/{name}", {"phase": "InProgress"})
        m, _ = self._run("restore", name, d, home)
        return m, d


# --- the case ---------------------------------------------------------------------------------------

OPS = [
    ("backup", "backup, cold cache"),
    ("backup-warm", "backup, warm cache"),
    ("incremental", "backup again, unchanged (incremental)"),
    ("restore-cold", "restore, cold cache"),
    ("restore-warm", "restore, warm cache"),
    ("restore-sparse-cold", "restore with sparse files, cold cache"),
    ("restore-sparse-warm", "restore with sparse files, warm cache"),
]


def run_side(bed, side, store, data, expect, verify, results, key, ops):
    """One side's sequence on one shape: OPS in order, those in `ops` only (the first backup
    always runs: the others need its snapshot). Appends samples to results."""
    ns = bed.namespace(store)
    home = os.path.join(bed.work, "homes", f"{side.name}-{ns}")
    os.makedirs(home)

    def ready(cold):
        drop_caches(cold)
        bed.store_requests()  # from here on: this transfer's requests only

    def rec(op, m):
        m["store"] = bed.store_requests()
        results.setdefault((key, op, side.name), []).append(m)
        reqs = " ".join(f"{k}={v}" for k, v in m["store"].items())
        log(f"    {side.name:6} {op:20} wall {m['wall']:7.2f} s  cpu {m['cpu']:7.2f} s  "
            f"rss {m['rss']:7.1f} MiB  read {m['read'] / 2**20:8.1f} MiB" + (f"  S3: {reqs}" if reqs else ""))

    # backup, cold: nothing cached, the page cache dropped.
    ready(True)
    m, sid, pod, vol = side.backup(ns, store, data, home)
    rec("backup", m)
    # backup again, unchanged: the parent and the side's kopia cache from the first.
    if "incremental" in ops:
        ready(False)
        m, _ = side.backup_again(ns, store, pod, vol, home)
        rec("incremental", m)
    # backup, warm: a fresh repository (another namespace), the data in the page cache.
    namespaces, homes = [ns], [home]
    if "backup-warm" in ops:
        ns2 = bed.namespace(store)
        home2 = os.path.join(bed.work, "homes", f"{side.name}-{ns2}")
        os.makedirs(home2)
        namespaces.append(ns2)
        homes.append(home2)
        ready(False)
        m, _, _, _ = side.backup(ns2, store, data, home2)
        rec("backup-warm", m)
    for sparse in (False, True):
        tag = "restore-sparse" if sparse else "restore"
        for cold in (True, False):
            op = f"{tag}-{'cold' if cold else 'warm'}"
            if op not in ops:
                continue
            if cold:
                side.forget_cache(ns, home)
            ready(cold)
            m, target = side.restore(ns, store, sid, sparse, home)
            rec(op, m)
            got = tree_digest(target) if verify else tree_summary(target)
            if got != (expect if verify else expect[:2]):
                raise RuntimeError(f"{side.name} restore into {target}: {got} != {expect}")
            shutil.rmtree(target)
    # Nothing of this run stays in the next one's way (or on the disk).
    if side.name == "agent":
        shutil.rmtree(vol)
    side.forget_cache(ns, home)
    for h in homes:
        shutil.rmtree(h, ignore_errors=True)
    bed.drop_repositories(store, namespaces)


def fmt(x, nd=2):
    return f"{x:.{nd}f}"


def requests(samples):
    """Median GETs (ranged or not) and connections one side's transfer made to the S3 server."""
    st = [x.get("store") or {} for x in samples]
    if not any(st):
        return "-"
    gets = statistics.median(c.get("GET", 0) + c.get("GET-range", 0) for c in st)
    conns = statistics.median(c.get("connections", 0) for c in st)
    return f"{gets:.0f} ({conns:.0f})"


def table(results, shapes, stores, runs):
    out = []
    out.append("| store | data | operation | agent wall s (min / med / max) | Velero wall s (min / med / max) | "
               "wall agent/Velero | CPU s agent / Velero | peak RSS MiB agent (its kopia) / Velero | RSS agent/Velero | "
               "read MiB agent / Velero | S3 GETs (connections) agent / Velero |")
    out.append("|---|---|---|---|---|---:|---|---|---:|---|---|")
    worst = []
    for store in stores:
        for shape, desc in shapes:
            key = (store, shape)
            for op, opdesc in OPS:
                a = results.get((key, op, "agent"), [])
                v = results.get((key, op, "velero"), [])
                if not a or not v:
                    continue
                med = lambda s, f: statistics.median(x[f] for x in s)
                mm = lambda s, f: f"{fmt(min(x[f] for x in s))} / {fmt(med(s, f))} / {fmt(max(x[f] for x in s))}"
                wr = med(a, "wall") / med(v, "wall")
                rr = med(a, "rss") / med(v, "rss")
                # Slower beyond the run's own spread: every agent run slower than every Velero run.
                beyond = min(x["wall"] for x in a) > max(x["wall"] for x in v)
                worst.append((wr, rr, store, shape, op, beyond))
                out.append(f"| {store} | {desc} | {opdesc} | {mm(a, 'wall')} | {mm(v, 'wall')} | {wr:.2f} | "
                           f"{fmt(med(a, 'cpu'))} / {fmt(med(v, 'cpu'))} | {med(a, 'rss'):.0f} ({med(a, 'uploader_rss'):.0f}) / {med(v, 'rss'):.0f} | "
                           f"{rr:.2f} | {med(a, 'read') / 2**20:.0f} / {med(v, 'read') / 2**20:.0f} | {requests(a)} / {requests(v)} |")
    return out, worst


def machine():
    """The machine and the code measured, for a section that may be rerun alone. Called when the
    run starts: commits made while it runs are not what it measured."""
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
    mem = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal:")), 0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "Cargo.toml"]).returncode != 0
    return (f"{cpu}, {os.cpu_count()} cores online, {mem >> 20} GiB, {os.uname().sysname} {os.uname().release}; "
            f"commit {commit or 'unknown'}{' (with local changes)' if dirty else ''}; "
            f"{time.strftime('%Y-%m-%d', time.gmtime())} (UTC)")


def write_report(a, bed, results, shapes, floors, agent_idle, cold_ok, started, done):
    """The report so far: written after every store and shape, so a run stopped early still
    leaves what it measured (and says it is partial). Not to a stream: only the whole report."""
    if not done and not os.path.isfile(a.out) and os.path.exists(a.out):
        return
    elapsed = time.monotonic() - started
    lines, worst = table(results, shapes, a.stores, a.runs)
    kopia_v = subprocess.run([a.kopia, "--version"], stdout=subprocess.PIPE, text=True).stdout.split("\n")[0]
    velero_v = subprocess.run([a.velero, "version", "--client-only"], stdout=subprocess.PIPE,
                              text=True).stdout.split("\n")
    velero_v = " ".join(l.strip() for l in velero_v if "Version" in l or "Git commit" in l)
    with open(a.out, "w") as f:
        w = lambda s="": f.write(s + "\n")
        w("## 9. agent vs Velero 1.18 data path")
        w()
        w(f"The same volumes backed up and restored by the agent (`podvolume-agent run`, its kopia {kopia_v.split()[0]} CLI "
          f"child) and by Velero's own data path (`velero pod-volume backup|restore`, what Velero 1.17+'s data-path "
          f"pods run: {velero_v}), driven by PodVolumeBackups/PodVolumeRestores on a real kube-apiserver "
          f"(`tools/bench/velero_path.py`). "
          + (f"{a.runs} runs per row, alternating which side goes first; " if a.runs > 1 else "1 run per row; ")
          + "min / median / max, ratios of medians. Every run's restore checked against the source "
          "(file count and size; the first run's byte for byte).")
        w()
        w(f"- Machine: {a.machine}.")
        w("- **agent**: from creating the object to seeing it Completed (a watch on the API): the claim, "
          "the status writes and kopia's `repository connect`, `policy set`, `snapshot create|restore`. "
          "CPU: the agent's own and its waited-for kopia children's. Peak RSS: agent + kopia summed, "
          "sampled every 20 ms.")
        w("- **Velero**: the life of the `velero pod-volume` process (Velero's kopia library in-process) on an "
          "object already InProgress; the data-path pod's scheduling and start and Velero's node agent are "
          "not counted. CPU and bytes read: its rusage. Peak RSS: the `velero` process, sampled every 20 ms.")
        w("- S3 GETs (connections): what the S3 server counted (`-stats`) from just before a transfer to its "
          "end, ranged or not, and the TLS connections opened for them: a warm restore served from kopia's "
          "content cache makes few; a new connection per read is the churn described below.")
        w("- Stores: " + "; ".join(f"*{s}*: {bed.stores[s]['what']}" for s in a.stores) +
          ". A fresh namespace, so a fresh repository (made with the kopia CLI, Velero's password, "
          "BackupRepository Ready), per side and run.")
        w(f"- Cold: {'the page cache dropped (`/proc/sys/vm/drop_caches`)' if cold_ok else 'the page cache could NOT be dropped (not root): cold means no kopia cache only'} "
          "and no kopia cache for the repository (the agent's per-repository cache in its scratch directory "
          "removed; Velero: a fresh HOME and cache volume). Warm: the data just read, the side's kopia cache kept. "
          "*backup, warm cache* is a full backup into another fresh repository with the data in the page cache; "
          "*backup again* is a second backup of the unchanged volume into the first repository (kopia's parent).")
        w("- In a cluster Velero's node agent starts a new data-path pod for every transfer, so its kopia cache "
          "is always empty (its *cold* rows are what it does there); the agent keeps each repository's cache "
          "and connection between transfers (bounded by `--kopia-cache-limit-mb`), so its *warm* rows are "
          "its usual case after the first transfer of a namespace.")
        for store, (plain, limited) in floors.items():
            w(f"- Memory floor, *{store}*: `kopia repository status` alone (one repository open: the key derived "
              f"with scrypt N=65536 r=8, 64 MiB) peaks at {plain:.0f} MiB ({limited:.0f} MiB with GOMEMLIMIT=32MiB); "
              f"the agent idle at {agent_idle:.0f} MiB. Velero's process makes the same open in-process.")
        w(f"- Run took {elapsed / 60:.0f} minutes." if done else
          f"- **Partial**: written after {elapsed / 60:.0f} minutes, before the run ended; "
          "rows are only those measured so far.")
        w()
        for l in lines:
            w(l)
        w()
        if worst:
            slower = [f"{x[2]} {x[3]} {x[4]} ({x[0]:.2f})" for x in worst if x[5]]
            w("Rows where the agent's fastest run was slower than Velero's slowest: "
              + ("; ".join(slower) if slower else "none")
              + (" (one run a row: that is every row above 1.00)." if a.runs == 1 else "."))
            wr = max(worst)
            rr = max(worst, key=lambda x: x[1])
            w(f"Largest wall ratio: {wr[0]:.2f} ({wr[2]}, {wr[3]}, {wr[4]}); largest RSS ratio: {rr[1]:.2f} "
              f"({rr[2]}, {rr[3]}, {rr[4]}).")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--agent", required=True)
    p.add_argument("--agent-arg", action="append", default=[])
    p.add_argument("--kopia", required=True)
    p.add_argument("--velero", required=True)
    p.add_argument("--cp-bin", required=True)
    p.add_argument("--crds", required=True)
    p.add_argument("--s3-server")
    p.add_argument("--stores", default="fs,s3")
    p.add_argument("--shapes", default="large,small,mixed")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a check of the harness itself, not a measurement")
    known_ops = ",".join(op for op, _ in OPS)
    p.add_argument("--ops", default=known_ops,
                   help="the operations to measure (the first backup always runs): " + known_ops)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    a.stores = [s for s in a.stores.split(",") if s]
    a.ops = [o for o in a.ops.split(",") if o]
    unknown = [o for o in a.ops if o not in dict(OPS)]
    if unknown:
        p.error(f"unknown --ops {','.join(unknown)} (known: {known_ops})")
    if a.tiny:
        sizes = {"large": 64 << 20, "small": 2000, "mixed_large": 8 << 20, "mixed_small": 500}
    elif a.quick:
        sizes = {"large": 512 << 20, "small": 20000, "mixed_large": 64 << 20, "mixed_small": 5000}
    else:
        sizes = {"large": 4 << 30, "small": 200000, "mixed_large": 512 << 20, "mixed_small": 20000}
    a.machine = machine()
    os.makedirs(a.work, exist_ok=True)
    check_free_space(a.work, [shape_bytes(sh, sizes) for sh in a.shapes.split(",")])
    bed = Bed(a)
    results = {}
    shapes = []
    cold_ok = drop_caches(True)
    started = time.monotonic()
    floors = {}
    try:
        bed.setup()
        agent_idle = rss_kib(bed.agent.pid) / 1024
        for store in a.stores:
            floors[store] = bed.open_floor(store)
        for shape in a.shapes.split(","):
            data = os.path.join(a.work, "data", shape)
            desc = make_shape(shape, data, sizes, seed=sum(shape.encode()))
            shapes.append((shape, desc))
            expect = tree_digest(data)
            log(f"data {shape}: {desc}: {expect[0]} files, {expect[1]} bytes")
            for store in a.stores:
                for r in range(a.runs):
                    order = [Agent(bed), Velero(bed)]
                    if r % 2:
                        order.reverse()
                    log(f"  {store} {shape} run {r + 1}/{a.runs}")
                    for side in order:
                        run_side(bed, side, store, data, expect, r == 0, results, (store, shape), a.ops)
                write_report(a, bed, results, shapes, floors, agent_idle, cold_ok, started, False)
            shutil.rmtree(data)
    finally:
        bed.stop()
    write_report(a, bed, results, shapes, floors, agent_idle, cold_ok, started, True)
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
