"""Velero's own PodVolumeBackup and PodVolumeRestore CRDs, as the project's unit tests read them.

The tests (src/agent/phases.rs, tests/manifests.rs) need Velero's CRDs of two versions without any
Velero binary or anything outside the project, so the two CRDs of each version served are kept in
testdata/velero-crds/v<version>/. They are what `velero install --crds-only --dry-run -o yaml`
prints, nothing edited; scripts/test-real-cluster.sh checks them against the binaries it builds on
every run, so they cannot drift from the Velero the tests name.

usage: crds.py write|check <output of velero install --crds-only --dry-run -o yaml> <dir>
  write   (re)writes <dir>/velero.io_podvolumebackups.yaml and velero.io_podvolumerestores.yaml
  check   exits 1, naming the difference, unless the files in <dir> hold the same objects
"""

import sys

import yaml

NAMES = ["podvolumebackups.velero.io", "podvolumerestores.velero.io"]


def crds_of(path):
    found = {}
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc:
                continue
            items = doc.get("items", []) if doc.get("kind") == "List" else [doc]
            for item in items:
                if item.get("kind") == "CustomResourceDefinition":
                    found[item["metadata"]["name"]] = item
    missing = [n for n in NAMES if n not in found]
    if missing:
        sys.exit(f"crds.py: {path} holds no CRD {', '.join(missing)}")
    return found


def file_of(dir_, name):
    return f"{dir_}/velero.io_{name.split('.')[0]}.yaml"


def first_difference(a, b, where="$"):
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{where}.{k}: only in {'the binary' if k in a else 'the file'}"
            d = first_difference(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("write", "check"):
        sys.exit(__doc__)
    mode, source, dir_ = sys.argv[1:]
    crds = crds_of(source)
    bad = 0
    for name in NAMES:
        path = file_of(dir_, name)
        if mode == "write":
            with open(path, "w") as f:
                f.write("# `velero install --crds-only --dry-run -o yaml`, this CRD only (tools/velero/crds.py)\n")
                yaml.safe_dump(crds[name], f, sort_keys=False)
            continue
        try:
            with open(path) as f:
                kept = yaml.safe_load(f)
        except OSError as e:
            print(f"crds.py: {path}: {e}")
            bad += 1
            continue
        d = first_difference(crds[name], kept)
        if d:
            print(f"crds.py: {path} differs from what the binary prints: {d}")
            bad += 1
    if bad:
        sys.exit(f"crds.py: regenerate with: python3 tools/velero/crds.py write <velero install output> {dir_}")


if __name__ == "__main__":
    main()
