"""Checks of scripts/velero-smoke.sh, on JSON it saved from the API server and kopia.

Each check prints one line, "  PASS <what>" or "  FAIL <what>: <why>", figures are printed
indented below; the exit status is 1 when any check failed.

usage: checks.py tree DIR                               JSON manifest of a volume directory
       checks.py pvbs PVBS.json EXPECTED.json NODE UPLOADER REPO_IDENTIFIER CRD.json
                                                          the PodVolumeBackups of a backup
       checks.py kopia SNAPSHOTS.json PVBS.json NS        kopia's snapshot list against them
       checks.py restic SNAPSHOTS.json PVBS.json NS       restic's snapshot list against them
       checks.py restored-pods PODS.json RESTORE.json EVENTS.jsonl VOLUMES.json
       checks.py pvrs PVRS.json PVBS.json EXPECTED.json NODE RESTORE.json CRD.json
       checks.py same-tree SRC DST LABEL                  byte-for-byte, modes and mtimes
       checks.py gone SNAPSHOTS.json PVBS.json            no snapshot of those PVBs is left (kopia or restic)
       checks.py cross SNAPSHOTS.json OURS VELEROS        our and Velero's manifest of one volume agree
       checks.py incremental PVBS.json FIRST SECOND PVC_UID UPLOADER BASE ADDED SNAPSHOTS.json|- CRD.json
                                                          the second backup of a claim has the first as parent
                                                          (restic's snapshot list; - for kopia)
"""
import datetime
import hashlib
import json
import os
import stat
import sys

failed = 0


def ok(what):
    print(f"  PASS {what}")


def bad(what, why):
    global failed
    failed += 1
    print(f"  FAIL {what}: {why}")


def check(cond, what, why=""):
    (ok(what) if cond else bad(what, why))
    return cond


def info(text):
    print(f"       {text}")


def load(path):
    with open(path) as f:
        return json.load(f)


def ts(s):
    return datetime.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ") if s else None


def tree(root):
    """{relative path: (kind, size, mode, mtime_ns, sha256)} for everything below root."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(d, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                out[rel] = ("file", st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns, h.hexdigest())
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", 0, stat.S_IMODE(st.st_mode), st.st_mtime_ns, "")
            else:
                out[rel] = ("other", st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns, "")
    return out


def snapshot_by_id(snaps, sid):
    """The snapshot whose ID is sid or starts with it (a PVB names a restic snapshot by its short
    ID, as Velero's restic path did; kopia IDs are whole), or None."""
    return next((s for s in snaps if sid and s["id"].startswith(sid)), None)


def owner_of(obj, *path):
    """Field managers owning obj's field at path (f:status, f:phase, ...)."""
    owners = []
    for m in obj["metadata"].get("managedFields") or []:
        f = m.get("fieldsV1") or {}
        for p in path:
            f = f.get(p)
            if f is None:
                break
        if f is not None:
            owners.append(m.get("manager"))
    return owners


def volume_key(obj):
    return f"{obj['spec']['pod']['name']}/{obj['spec']['volume']}"


def status_fields(crd):
    """The status fields the served CRD's schema has (the API server drops any other)."""
    v = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return set((v["properties"].get("status") or {}).get("properties") or {})


def transfer_checks(kind, items, expected, node, crd, uploader="kopia", repo_identifier=""):
    fields = status_fields(crd)
    by_key = {volume_key(i): i for i in items}
    check(sorted(by_key) == sorted(expected), f"one {kind} per volume ({len(expected)})",
          f"got {sorted(by_key)}, expected {sorted(expected)}")
    for key in sorted(by_key):
        o = by_key[key]
        st, name = o.get("status") or {}, o["metadata"]["name"]
        prog = st.get("progress") or {}
        want = expected.get(key)
        tc, ta = ts(o["metadata"].get("creationTimestamp")), ts(st.get("acceptedTimestamp"))
        t0, t1 = ts(st.get("startTimestamp")), ts(st.get("completionTimestamp"))
        secs = lambda a, b: f"{(b - a).total_seconds():.0f}s" if a and b else "?"
        info(f"{kind} {name} ({key}): phase={st.get('phase')} snapshotID={st.get('snapshotID') or o['spec'].get('snapshotID')} "
             f"bytesDone={prog.get('bytesDone')} totalBytes={prog.get('totalBytes')} written={want} "
             f"created->accepted={secs(tc, ta)} accepted->started={secs(ta, t0)} started->completed={secs(t0, t1)} "
             f"message={st.get('message')!r}")
        check(st.get("phase") == "Completed", f"{kind} {key} Completed",
              f"phase {st.get('phase')!r}, message {st.get('message')!r}")
        check(prog.get("bytesDone") == prog.get("totalBytes") == want,
              f"{kind} {key} progress bytesDone == totalBytes == bytes written ({want})",
              f"bytesDone {prog.get('bytesDone')}, totalBytes {prog.get('totalBytes')}")
        owners = owner_of(o, "f:status", "f:phase")
        check(owners == ["podvolume-agent"], f"{kind} {key} status.phase written by podvolume-agent",
              f"owners of status.phase: {owners}")
        check("velero.io/pod-volume-finalizer" not in (o["metadata"].get("finalizers") or []),
              f"{kind} {key} finalizer removed", str(o["metadata"].get("finalizers")))
        if kind == "PodVolumeBackup":
            check(o["spec"].get("node") == node and o["spec"].get("uploaderType") == uploader
                  and o["spec"].get("repoIdentifier", "") == repo_identifier,
                  f"{kind} {key} is Velero's {uploader} request (spec.node {node}, uploaderType {uploader}, "
                  f"repoIdentifier {repo_identifier!r})",
                  json.dumps({k: o["spec"].get(k) for k in ("node", "uploaderType", "repoIdentifier")}))
            check(bool(st.get("snapshotID")), f"{kind} {key} has a snapshotID", "empty")
            inc = st.get("incrementalBytes")
            if "incrementalBytes" not in fields:
                # Velero <= 1.16's CRD: the API server drops the field the agent writes.
                check(inc is None, f"{kind} {key} has no incrementalBytes (not in this Velero's CRD)", repr(inc))
            elif uploader == "kopia":
                # The volume's first backup: every byte read, none from a parent (exact for kopia).
                check(inc == want, f"{kind} {key} incrementalBytes == bytes written (a first backup)",
                      f"incrementalBytes {inc!r}")
            else:
                # restic's data_added: every file byte of a first backup plus its tree blobs.
                check(isinstance(inc, int) and want <= inc <= want + 65536,
                      f"{kind} {key} incrementalBytes {inc} = bytes written {want} + restic's tree blobs "
                      f"(a first backup)", f"incrementalBytes {inc!r}")
        elif "node" in fields:
            check(st.get("node") == node, f"{kind} {key} status.node is {node}", repr(st.get("node")))
        else:
            # Velero <= 1.16's CRD has no status.node: the API server drops what the agent writes.
            check(st.get("node") is None, f"{kind} {key} has no status.node (not in this Velero's CRD)", repr(st.get("node")))
    return by_key


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "tree":
        t = tree(args[0])
        print(json.dumps({k: list(v) for k, v in t.items()}))
        return
    if cmd == "pvbs":
        pvbs, expected, node, uploader, repo, crd = (load(args[0])["items"], load(args[1]), args[2], args[3],
                                                     args[4], load(args[5]))
        transfer_checks("PodVolumeBackup", pvbs, expected, node, crd, uploader, repo)
    elif cmd == "restic":
        snaps, pvbs, ns = load(args[0]) or [], load(args[1])["items"], args[2]
        by_id = {s["id"]: s for s in snaps}
        info(f"restic snapshots: {len(snaps)} snapshot(s)")
        for s in snaps:
            info(f"  {s['id'][:16]} host={s.get('hostname')} paths={s.get('paths')} tags={s.get('tags')} "
                 f"parent={(s.get('parent') or '')[:16]}")
        for p in pvbs:
            key, sid = volume_key(p), (p.get("status") or {}).get("snapshotID") or ""
            s = snapshot_by_id(snaps, sid)
            if not check(s is not None, f"restic snapshot {sid[:16]} of {key} is in the repository",
                         f"not among {sorted(by_id)}"):
                continue
            check(s.get("hostname") == "velero", f"snapshot {sid[:16]} has host velero (Velero's)", s.get("hostname"))
            tags = dict(t.split("=", 1) for t in s.get("tags") or [] if "=" in t)
            want = {"backup": p["metadata"]["labels"].get("velero.io/backup-name"), "ns": ns,
                    "pod": p["spec"]["pod"]["name"], "volume": p["spec"]["volume"]}
            check(all(tags.get(k) == v for k, v in want.items()),
                  f"snapshot {sid[:16]} carries the PVB's tags {want}", json.dumps(tags))
    elif cmd == "kopia":
        snaps, pvbs, ns = load(args[0]), load(args[1])["items"], args[2]
        by_id = {s["id"]: s for s in snaps}
        info(f"kopia snapshot list --all: {len(snaps)} manifest(s)")
        for s in snaps:
            src = s.get("source", {})
            info(f"  {s['id']} {src.get('userName')}@{src.get('host')}:{src.get('path')} "
                 f"size={s.get('rootEntry', {}).get('summ', {}).get('size')} "
                 f"description={s.get('description')!r} pins={s.get('pins')} "
                 f"tags={s.get('tags')}")
        for p in pvbs:
            key, sid = volume_key(p), (p.get("status") or {}).get("snapshotID")
            s = by_id.get(sid)
            if not check(s is not None, f"kopia manifest {sid} of {key} is in the repository",
                         f"not among {sorted(by_id)}"):
                continue
            src = s.get("source", {})
            want = f"snapshot-pod-volume/kopia/{ns}/{key}"
            check(src.get("userName") == "default" and src.get("host") == "default" and src.get("path") == want,
                  f"manifest {sid} source is default@default:{want} (Velero 1.18's)",
                  f"{src.get('userName')}@{src.get('host')}:{src.get('path')}")
            size = s.get("rootEntry", {}).get("summ", {}).get("size")
            check(size == (p.get("status") or {}).get("progress", {}).get("totalBytes"),
                  f"manifest {sid} root size {size} == PVB totalBytes")
            check(s.get("description") == "Kopia Uploader" and "velero-pin" in (s.get("pins") or []),
                  f"manifest {sid} has description 'Kopia Uploader' and pin velero-pin",
                  f"description {s.get('description')!r}, pins {s.get('pins')}")
            tags = s.get("tags") or {}
            tag = lambda k: tags.get(k, tags.get(f"tag:{k}"))
            check(tag("backup") == p["metadata"]["labels"].get("velero.io/backup-name")
                  and tag("volume") == p["spec"]["volume"],
                  f"manifest {sid} carries the PVB's tags (backup, volume)", json.dumps(tags))
            # Velero's own uploader files its snapshots with these two tags (unprefixed keys)
            # and picks a parent only among snapshots that have them.
            if tags.get("snapshot-requester") != "snapshot-pod-volume" or tags.get("snapshot-uploader") != "kopia":
                info(f"NOTE manifest {sid} lacks Velero's own tags snapshot-requester=snapshot-pod-volume, "
                     f"snapshot-uploader=kopia (unprefixed): Velero's node agent would not take it as a parent")
            check(not s.get("incomplete"), f"manifest {sid} is complete", repr(s.get("incomplete")))
    elif cmd == "volumeinfo":
        vols, pvbs = load(args[0]), load(args[1])["items"]
        by_key = {f"{(v.get('pvbInfo') or {}).get('podName')}/{(v.get('pvbInfo') or {}).get('volumeName')}": v for v in vols}
        info(f"Velero's volume info of the backup: {len(vols)} volume(s)")
        for p in pvbs:
            key, st = volume_key(p), p["status"]
            v = by_key.get(key) or {}
            pi = v.get("pvbInfo") or {}
            info(f"  {key}: backupMethod={v.get('backupMethod')} snapshotHandle={pi.get('snapshotHandle')} "
                 f"size={pi.get('size')} uploaderType={pi.get('uploaderType')} node={pi.get('nodeName')} "
                 f"start={v.get('startTimestamp')} completion={v.get('completionTimestamp')}")
            check(v.get("backupMethod") == "PodVolumeBackup" and pi.get("snapshotHandle") == st.get("snapshotID")
                  and pi.get("size") == st.get("progress", {}).get("totalBytes"),
                  f"Velero recorded {key} as a PodVolumeBackup with the agent's snapshot ID and size",
                  json.dumps(v))
    elif cmd == "events":
        events, objs = load(args[0])["items"], []
        for f in args[1:]:
            objs += load(f)["items"]
        for o in objs:
            uid, kind = o["metadata"]["uid"], o["kind"]
            mine = [e for e in events if (e.get("involvedObject") or {}).get("uid") == uid]
            reasons = [e.get("reason") for e in sorted(mine, key=lambda e: e.get("eventTime") or e.get("firstTimestamp") or "")]
            by = sorted({e.get("reportingComponent") or (e.get("source") or {}).get("component") or "?" for e in mine})
            info(f"{kind} {o['metadata']['name']} ({volume_key(o)}): Events {reasons} from {by}")
            check(all(r in reasons for r in ("Accepted", "Started", "Completed")) and by == ["podvolume-agent"],
                  f"{kind} {volume_key(o)}: Events Accepted, Started, Completed from podvolume-agent")
    elif cmd == "restored-pods":
        pods, restore, events, volumes = load(args[0])["items"], load(args[1]), args[2], load(args[3])
        ruid = restore["metadata"]["uid"]
        done = [json.loads(l) for l in open(events) if '"restore-helper-done"' in l]
        by_name = {p["metadata"]["name"]: p for p in pods}
        check(sorted(by_name) == sorted(volumes), f"restored pods {sorted(volumes)}", f"got {sorted(by_name)}")
        for name, vols in sorted(volumes.items()):
            p = by_name.get(name)
            if p is None:
                continue
            init = (p["spec"].get("initContainers") or [{}])[0]
            mounts = sorted(m["name"] for m in init.get("volumeMounts", []) if m["mountPath"].startswith("/restores/"))
            info(f"pod {name} uid {p['metadata']['uid']}: init container {init.get('name')} image {init.get('image')} "
                 f"args {init.get('args')} mounts {mounts}; phase {p.get('status', {}).get('phase')}")
            check(init.get("name") == "restore-wait" and init.get("args") == [ruid] and mounts == sorted(vols),
                  f"pod {name} got Velero's restore helper (restore-wait {ruid}) mounting {sorted(vols)}")
            ev = [e for e in done if e["uid"] == p["metadata"]["uid"]]
            files = sorted(ev[0]["doneFiles"]) if ev else []
            check(len(ev) == 1 and ev[0]["restoreUID"] == ruid and len(files) == len(vols)
                  and all(f.endswith(f"/.velero/{ruid}") for f in files),
                  f"pod {name}: the restore helper found the done file .velero/{ruid} in each of its {len(vols)} volume(s)",
                  f"events {ev}")
            for f in files:
                info(f"  done file {f}")
            if ev:
                # Velero's helper then removes each .velero folder; as uid 1000 (its default
                # securityContext) it cannot remove a folder the node agent made as root, in
                # Velero's own node agent as in ours: what it said is shown, not judged.
                info(f"  after the done files the helper said: {ev[0].get('cleanup')}")
            check(p.get("status", {}).get("phase") == "Running", f"pod {name} Running after the helper exited",
                  p.get("status", {}).get("phase"))
    elif cmd == "pvrs":
        pvrs, pvbs, expected, node, restore, crd = (load(args[0])["items"], load(args[1])["items"], load(args[2]),
                                                    args[3], load(args[4]), load(args[5]))
        by_key = transfer_checks("PodVolumeRestore", pvrs, expected, node, crd)
        snap = {volume_key(p): p["status"].get("snapshotID") for p in pvbs}
        for key, o in sorted(by_key.items()):
            check(o["spec"].get("snapshotID") == snap.get(key),
                  f"PodVolumeRestore {key} restores the PVB's snapshot {snap.get(key)}", o["spec"].get("snapshotID"))
            check(o["metadata"]["labels"].get("velero.io/restore-uid") == restore["metadata"]["uid"],
                  f"PodVolumeRestore {key} belongs to restore {restore['metadata']['name']}")
    elif cmd == "orphans":
        # orphans REPO_JSON BACKUPS_JSON PVBS_JSON kopia|restic: every snapshot in the repository
        # is the snapshotID of a PodVolumeBackup whose Backup exists.
        snaps, backups, pvbs, uploader = load(args[0]), load(args[1])["items"], load(args[2])["items"], args[3]
        existing = {b["metadata"]["name"] for b in backups}
        kept = {p.get("status", {}).get("snapshotID") for p in pvbs
                if p["metadata"].get("labels", {}).get("velero.io/backup-name") in existing}
        kept.discard(None)
        kept.discard("")
        ids = []
        for s in snaps or []:
            if uploader == "kopia":
                ids.append((s["id"], s.get("incomplete") or "complete"))
            else:
                ids.append((s["short_id"] if s["short_id"] in kept else s["id"], "restic"))
        info(f"repository of the slow volume: {len(ids)} snapshot(s) {ids}; referenced by a PVB of an existing Backup: {sorted(kept)}")
        stray = [i for i in ids if i[0] not in kept]
        check(not stray, "no snapshot in the repository outside a Backup (none left by a stopped, replaced or orphaned transfer)",
              f"not referenced: {stray}")
    elif cmd == "same-tree":
        a, b, label = tree(args[0]), tree(args[1]), args[2]
        # same-tree SRC DST LABEL [RESTORE_UID]: the done file Velero's restore helper waited for
        # (.velero/<restore UID>, left when the helper could not remove it) is the one entry a
        # restore may add.
        if len(args) > 3:
            extra = {".velero", f".velero/{args[3]}"}
            left = sorted(extra & (set(b) - set(a)))
            if left:
                info(f"{label}: the restore's done file is still in the volume: {left}")
            b = {k: v for k, v in b.items() if k not in extra or k in a}
        files = [k for k, v in a.items() if v[0] == "file"]
        info(f"{label}: {len(files)} files, {sum(a[k][1] for k in files)} bytes, {len(a) - len(files)} directories in the source")
        check(sorted(a) == sorted(b), f"{label}: same entries", f"only in source {sorted(set(a) - set(b))}, "
              f"only in restore {sorted(set(b) - set(a))}")
        diff = [k for k in a if k in b and (a[k][0], a[k][1], a[k][4]) != (b[k][0], b[k][1], b[k][4])]
        check(not diff, f"{label}: every file identical byte for byte (sha256)", f"differ: {diff}")
        modes = [k for k in a if k in b and a[k][2] != b[k][2]]
        check(not modes, f"{label}: modes kept", ", ".join(f"{k}: {oct(a[k][2])} -> {oct(b[k][2])}" for k in modes))
        mt = [k for k in a if k in b and a[k][0] == "file" and a[k][3] != b[k][3]]
        check(not mt, f"{label}: file mtimes kept (ns)", ", ".join(f"{k}: {a[k][3]} -> {b[k][3]}" for k in mt))
    elif cmd == "cross":
        snaps, ours, velero = load(args[0]), args[1], args[2]
        by_id = {s["id"]: s for s in snaps}
        a, b = by_id.get(ours), by_id.get(velero)
        if not (check(a is not None, f"our manifest {ours} is in the repository", f"not among {sorted(by_id)}")
                and check(b is not None, f"Velero's manifest {velero} is in the repository", f"not among {sorted(by_id)}")):
            sys.exit(1)
        for who, s in (("ours", a), ("Velero's", b)):
            src, st = s.get("source", {}), s.get("stats", {})
            info(f"{who}: {s['id']} {src.get('userName')}@{src.get('host')}:{src.get('path')} "
                 f"tags={s.get('tags')} pins={s.get('pins')} description={s.get('description')!r} "
                 f"files={st.get('fileCount')} cachedFiles={st.get('cachedFiles')} nonCachedFiles={st.get('nonCachedFiles')}")
        check(a.get("source") == b.get("source"),
              "Velero's data path files its snapshot under the same source (user@host:path) as ours",
              f"ours {a.get('source')}, Velero's {b.get('source')}")
        check(not b.get("incomplete"), f"Velero's manifest {velero} is complete", repr(b.get("incomplete")))
        check(a.get("rootEntry", {}).get("obj") == b.get("rootEntry", {}).get("obj"),
              "both snapshots of the unchanged volume have the same root object (same content, same metadata)",
              f"ours {a.get('rootEntry', {}).get('obj')}, Velero's {b.get('rootEntry', {}).get('obj')}")
        # Velero's uploader takes a parent only among snapshots tagged (unprefixed) snapshot-requester
        # and snapshot-uploader; the kopia CLI files every tag as tag:<key>, so it re-reads the files
        # (no data is uploaded twice: kopia's content store deduplicates). Reported, not asserted.
        st = b.get("stats", {})
        info(f"Velero's backup after ours: {st.get('cachedFiles')} of {st.get('fileCount')} files taken from a parent "
             f"snapshot without reading them ({'our snapshot served as its parent' if st.get('cachedFiles') else 'no parent: every file re-read'})")
    elif cmd == "incremental":
        pvbs, first, second, pvc_uid, uploader = load(args[0])["items"], args[1], args[2], args[3], args[4]
        base, added, fields = int(args[5]), int(args[6]), status_fields(load(args[8]))
        snaps = [] if args[7] == "-" else load(args[7]) or []
        by_backup = {p["metadata"]["labels"].get("velero.io/backup-name"): p for p in pvbs}
        a, b = by_backup.get(first), by_backup.get(second)
        if not (check(a is not None, f"a PodVolumeBackup of {first}", f"got {sorted(by_backup)}")
                and check(b is not None, f"a PodVolumeBackup of {second}", f"got {sorted(by_backup)}")):
            sys.exit(1)
        for p, want in ((a, base), (b, base + added)):
            st, name = p.get("status") or {}, p["metadata"]["labels"].get("velero.io/backup-name")
            prog = st.get("progress") or {}
            info(f"{name}: PodVolumeBackup {p['metadata']['name']} phase={st.get('phase')} snapshotID={st.get('snapshotID')} "
                 f"totalBytes={prog.get('totalBytes')} incrementalBytes={st.get('incrementalBytes')} "
                 f"labels={ {k: v for k, v in p['metadata']['labels'].items() if k.startswith('velero.io/pvc')} }")
            check(st.get("phase") == "Completed" and prog.get("bytesDone") == prog.get("totalBytes") == want,
                  f"{name}: PodVolumeBackup Completed with bytesDone == totalBytes == {want}",
                  f"phase {st.get('phase')}, progress {prog}")
            check(p["metadata"]["labels"].get("velero.io/pvc-uid") == pvc_uid,
                  f"{name}: Velero labelled the PodVolumeBackup velero.io/pvc-uid={pvc_uid} (the claim's)",
                  json.dumps(p["metadata"]["labels"]))
        sa, sb = a["status"].get("snapshotID") or "", b["status"].get("snapshotID") or ""
        if "incrementalBytes" in fields:
            ia, ib = a["status"].get("incrementalBytes"), b["status"].get("incrementalBytes")
            check(ia == base, f"{first}: incrementalBytes {ia} == every byte ({base}): a first backup")
            # kopia's figure for a partly cached snapshot is a lower bound by at most 0.1 of its unit.
            check(isinstance(ib, int) and added - 100 <= ib <= added,
                  f"{second}: incrementalBytes {ib} == only the added file ({added}, kopia's figure within 100 below)",
                  repr(ib))
        if uploader == "restic":
            fa, fb = snapshot_by_id(snaps, sa), snapshot_by_id(snaps, sb)
            info(f"restic snapshots of the claim's namespace: " + ", ".join(
                f"{s['id'][:8]} parent={(s.get('parent') or '')[:8]} tags={s.get('tags')}" for s in snaps))
            if check(fa is not None and fb is not None, f"both snapshots ({sa}, {sb}) are in the repository",
                     f"not among {[s['id'] for s in snaps]}"):
                check(fb.get("parent") == fa["id"], f"restic recorded {first}'s snapshot {sa} as the parent of "
                      f"{second}'s {sb}", f"parent {fb.get('parent')!r}")
    elif cmd == "gone":
        snaps, pvbs = load(args[0]) or [], load(args[1])["items"]
        ids = {s["id"] for s in snaps}
        info(f"snapshots in the repository after the delete: {len(snaps)} {sorted(ids)}")
        for p in pvbs:
            sid = p["status"].get("snapshotID")
            check(sid and snapshot_by_id(snaps, sid) is None,
                  f"snapshot {sid} ({volume_key(p)}) deleted from the repository")
    else:
        sys.exit(f"unknown command {cmd}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
