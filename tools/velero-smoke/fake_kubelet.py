"""Plays the kubelet (and the scheduler) of one node for scripts/velero-smoke.sh.

The control plane of scripts/start-control-plane.sh has no kubelet and no scheduler, so pods are
stored but never placed or run. This process does, for one node, what those two would do as far
as Velero and the node agent can tell from the API server:

- registers the Node (labels kubernetes.io/{hostname,os,arch}, status Ready) and renews its Lease
  in kube-node-lease every 10 s, so the node lifecycle controller never marks it unreachable (and
  taint-based eviction never deletes the pods on it);
- binds every unscheduled pod to this node (pods/binding, as kube-scheduler does);
- for each pod on this node: creates its emptyDir volumes at
  <pods-dir>/<pod-uid>/volumes/kubernetes.io~empty-dir/<volume> and its claims bound to CSI
  PersistentVolumes at <pods-dir>/<pod-uid>/volumes/kubernetes.io~csi/<pv-name>/mount (kubelet's
  layout, which the node agent reads as --host-pods-dir; a pod whose claim is not bound yet waits,
  as the kubelet does), then writes the status a kubelet writes: init containers run one after
  the other, then the containers run (phase Running, Ready);
- runs Velero's restore helper init container (restore-wait, restic-wait before Velero 1.10) as
  cmd/velero-restore-helper does: it stays running until every volume mounted under /restores/
  has the done file .velero/<restore UID> (its only argument), then removes those .velero
  directories and exits 0;
- a pod being deleted has its volume directories removed and is then deleted with grace period 0,
  as the kubelet finishes a deletion.

Every action is appended to --events as one JSON object per line (the smoke script checks them).

usage: fake_kubelet.py --server URL --ca CA --cert CERT --key KEY --node NAME --pods-dir DIR
                       --events FILE [--interval SECONDS]
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import ssl
import sys
import time
import urllib.error
import urllib.request

HELPERS = ("restore-wait", "restic-wait")
EMPTY_DIR = "kubernetes.io~empty-dir"
CSI = "kubernetes.io~csi"


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Api:
    def __init__(self, server, ca, cert, key):
        self.server = server.rstrip("/")
        self.ctx = ssl.create_default_context(cafile=ca)
        self.ctx.load_cert_chain(cert, key)

    def call(self, method, path, body=None, content_type="application/json", ok404=False):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if ok404 and e.code in (404, 409):
                return None
            raise RuntimeError(f"{method} {path}: {e.code} {e.read().decode(errors='replace')[:500]}") from None

    def patch(self, path, body):
        return self.call("PATCH", path, body, "application/merge-patch+json")


class Kubelet:
    def __init__(self, args):
        self.args = args
        self.api = Api(args.server, args.ca, args.cert, args.key)
        self.node = args.node
        self.pods_dir = os.path.abspath(args.pods_dir)
        self.events = open(args.events, "a", buffering=1)
        # per pod UID: what we last wrote, when its containers started, its IP, helper done
        self.pods = {}
        self.next_ip = 10
        self.last_lease = 0.0
        self.last_node_status = 0.0

    def event(self, **kw):
        kw = {"time": now_micro(), **kw}
        self.events.write(json.dumps(kw, sort_keys=True) + "\n")
        print(f"fake-kubelet: {kw}", file=sys.stderr, flush=True)

    # --- the node -------------------------------------------------------------------------------
    def register(self):
        labels = {
            "kubernetes.io/hostname": self.node,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        node = self.api.call("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.node, "labels": labels},
        }, ok404=True) or self.api.call("GET", f"/api/v1/nodes/{self.node}")
        self.node_uid = node["metadata"]["uid"]
        self.node_status(first=True)
        self.api.call("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.node, "ownerReferences": [{
                "apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node_uid}]},
            "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": now_micro()},
        }, ok404=True)
        self.last_lease = time.monotonic()
        self.event(action="node-registered", node=self.node, uid=self.node_uid)

    def node_status(self, first=False):
        t = now()
        status = {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady",
             "message": "kubelet is posting ready status", "lastHeartbeatTime": t,
             **({"lastTransitionTime": t} if first else {})},
            {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
             "lastHeartbeatTime": t, **({"lastTransitionTime": t} if first else {})},
            {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure",
             "lastHeartbeatTime": t, **({"lastTransitionTime": t} if first else {})},
            {"type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID",
             "lastHeartbeatTime": t, **({"lastTransitionTime": t} if first else {})},
        ]}
        if first:
            status.update({
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": self.node}],
                "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
                "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
                "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                             "kubeletVersion": "v1.37.2", "kubeProxyVersion": "",
                             "containerRuntimeVersion": "none://0", "osImage": "fake",
                             "kernelVersion": os.uname().release, "machineID": "",
                             "systemUUID": "", "bootID": ""},
            })
        else:
            # The merge patch replaces the list: keep lastTransitionTime by re-reading it.
            cur = self.api.call("GET", f"/api/v1/nodes/{self.node}")
            old = {c["type"]: c for c in cur.get("status", {}).get("conditions", [])}
            for c in status["conditions"]:
                c["lastTransitionTime"] = old.get(c["type"], {}).get("lastTransitionTime", t)
        self.api.patch(f"/api/v1/nodes/{self.node}/status", {"status": status})
        self.last_node_status = time.monotonic()

    def heartbeat(self):
        if time.monotonic() - self.last_lease >= 10:
            self.api.patch(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}",
                           {"spec": {"renewTime": now_micro(), "holderIdentity": self.node}})
            self.last_lease = time.monotonic()
        if time.monotonic() - self.last_node_status >= 60:
            self.node_status()

    # --- pods -----------------------------------------------------------------------------------
    def volume_dir(self, uid, volume):
        return os.path.join(self.pods_dir, uid, "volumes", self.pods[uid]["dirs"][volume])

    def volume_dirs(self, pod):
        """{volume: its directory below <pod-uid>/volumes/}, or None while a claim is unbound."""
        dirs = {}
        for v in pod["spec"].get("volumes", []):
            if "emptyDir" in v:
                dirs[v["name"]] = os.path.join(EMPTY_DIR, v["name"])
            elif "persistentVolumeClaim" in v:
                ns, claim = pod["metadata"]["namespace"], v["persistentVolumeClaim"]["claimName"]
                pvc = self.api.call("GET", f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{claim}", ok404=True)
                pv_name = ((pvc or {}).get("spec") or {}).get("volumeName")
                if not pvc or (pvc.get("status") or {}).get("phase") != "Bound" or not pv_name:
                    return None
                pv = self.api.call("GET", f"/api/v1/persistentvolumes/{pv_name}", ok404=True)
                if not pv or "csi" not in pv["spec"]:
                    raise RuntimeError(f"claim {ns}/{claim}: PersistentVolume {pv_name} is not a CSI volume")
                dirs[v["name"]] = os.path.join(CSI, pv_name, "mount")
        return dirs

    def bind(self, pod):
        md = pod["metadata"]
        self.api.call("POST", f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/binding", {
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": md["name"], "uid": md["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
        }, ok404=True)
        self.event(action="bound", namespace=md["namespace"], pod=md["name"], uid=md["uid"])

    def helper_done(self, uid, helper):
        """What cmd/velero-restore-helper checks: .velero/<restore UID> in every /restores/<dir>."""
        restore_uid = (helper.get("args") or [""])[0]
        found = []
        for m in helper.get("volumeMounts", []):
            if not m.get("mountPath", "").startswith("/restores/"):
                continue
            done = os.path.join(self.volume_dir(uid, m["name"]), ".velero", restore_uid)
            if not os.path.isfile(done):
                return None
            found.append(done)
        return restore_uid, found

    def sync(self, pod):
        md, spec = pod["metadata"], pod["spec"]
        uid = md["uid"]
        if md.get("deletionTimestamp"):
            shutil.rmtree(os.path.join(self.pods_dir, uid), ignore_errors=True)
            self.api.call("DELETE", f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}",
                          {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                           "preconditions": {"uid": uid}}, ok404=True)
            self.pods.pop(uid, None)
            self.event(action="deleted", namespace=md["namespace"], pod=md["name"], uid=uid)
            return
        st = self.pods.get(uid)
        if st is None:
            dirs = self.volume_dirs(pod)
            if dirs is None:
                return  # a claim not bound yet: look again at the next tick
            for d in dirs.values():
                os.makedirs(os.path.join(self.pods_dir, uid, "volumes", d), exist_ok=True)
            self.next_ip += 1
            st = {"written": None, "started": now(), "ip": f"10.244.0.{self.next_ip}",
                  "init_done": {}, "init_started": {}, "dirs": dirs}
            self.pods[uid] = st
            self.event(action="volumes-created", namespace=md["namespace"], pod=md["name"], uid=uid,
                       volumes=sorted(dirs))

        # Init containers in order: the first one not finished is running.
        init_statuses, running_init = [], None
        for c in spec.get("initContainers", []):
            name = c["name"]
            if running_init is None and name not in st["init_done"]:
                st["init_started"].setdefault(name, now())
                if name in HELPERS:
                    res = self.helper_done(uid, c)
                    if res is not None:
                        restore_uid, found = res
                        for m in c.get("volumeMounts", []):
                            if m.get("mountPath", "").startswith("/restores/"):
                                shutil.rmtree(os.path.join(self.volume_dir(uid, m["name"]), ".velero"),
                                              ignore_errors=True)
                        st["init_done"][name] = now()
                        self.event(action="restore-helper-done", namespace=md["namespace"], pod=md["name"],
                                   uid=uid, restoreUID=restore_uid, doneFiles=found)
                else:
                    st["init_done"][name] = now()
                if name not in st["init_done"]:
                    running_init = name
            if name in st["init_done"]:
                state = {"terminated": {"exitCode": 0, "reason": "Completed",
                                        "startedAt": st["init_started"][name],
                                        "finishedAt": st["init_done"][name]}}
            elif name == running_init:
                state = {"running": {"startedAt": st["init_started"][name]}}
            else:
                state = {"waiting": {"reason": "PodInitializing"}}
            init_statuses.append({"name": name, "image": c.get("image", ""), "imageID": "",
                                  "ready": name in st["init_done"], "restartCount": 0,
                                  "started": name == running_init, "state": state})
        initialized = running_init is None
        if initialized and "containers_started" not in st:
            st["containers_started"] = now()
        statuses = []
        for c in spec.get("containers", []):
            state = ({"running": {"startedAt": st["containers_started"]}} if initialized
                     else {"waiting": {"reason": "PodInitializing"}})
            statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                             "ready": initialized, "restartCount": 0, "started": initialized,
                             "state": state})

        def cond(t, ok, reason=None):
            c = {"type": t, "status": "True" if ok else "False", "lastProbeTime": None,
                 "lastTransitionTime": st["started"]}
            if not ok and reason:
                c["reason"] = reason
            return c

        status = {
            "phase": "Running" if initialized else "Pending",
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": st["ip"], "podIPs": [{"ip": st["ip"]}],
            "startTime": st["started"],
            "conditions": [
                cond("PodReadyToStartContainers", True),
                cond("Initialized", initialized, "ContainersNotInitialized"),
                cond("Ready", initialized, "ContainersNotReady"),
                cond("ContainersReady", initialized, "ContainersNotReady"),
                cond("PodScheduled", True),
            ],
            "containerStatuses": statuses,
        }
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        if status != st["written"]:
            self.api.patch(f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/status",
                           {"status": status})
            st["written"] = status
            self.event(action="status", namespace=md["namespace"], pod=md["name"], uid=uid,
                       phase=status["phase"], runningInit=running_init)

    def tick(self):
        self.heartbeat()
        pods = self.api.call("GET", "/api/v1/pods")["items"]
        seen = set()
        for pod in pods:
            spec = pod["spec"]
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            if not spec.get("nodeName"):
                if not pod["metadata"].get("deletionTimestamp"):
                    self.bind(pod)
                continue
            if spec["nodeName"] != self.node:
                continue
            seen.add(pod["metadata"]["uid"])
            try:
                self.sync(pod)
            except RuntimeError as e:
                # A pod changed under us (deleted, a conflict): look again at the next tick.
                print(f"fake-kubelet: {e}", file=sys.stderr, flush=True)
        for uid in list(self.pods):
            if uid not in seen:
                self.pods.pop(uid)

    def run(self):
        self.register()
        while True:
            try:
                self.tick()
            except (RuntimeError, OSError) as e:
                print(f"fake-kubelet: {e}", file=sys.stderr, flush=True)
            time.sleep(self.args.interval)


def main():
    p = argparse.ArgumentParser()
    for a in ("--server", "--ca", "--cert", "--key", "--node", "--pods-dir", "--events"):
        p.add_argument(a, required=True)
    p.add_argument("--interval", type=float, default=0.5)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Kubelet(args).run()


if __name__ == "__main__":
    main()
