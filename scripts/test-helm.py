#!/usr/bin/env python3
"""Checks of what `helm template` renders from charts/podvolume-agent, run by scripts/test-helm.sh
(which runs helm and kubectl and passes their output here as files). Each subcommand prints what it
checked and exits non-zero with the reasons when something does not hold.

  test-helm.py defaults RENDERED KUSTOMIZED RUN_HELP VALUES NAMESPACE
      the chart with default values: the DaemonSet's name, labels and namespace; every flag of
      `podvolume-agent run` (from its --help) is a value of `agent`, commented with that flag and
      its default, described by values.schema.json, and renders as the binary's default; the pod
      spec equals daemonset/'s
  test-helm.py custom RENDERED VALUES NAMESPACE
      the chart with the non-default VALUES: each of them where it belongs
  test-helm.py rbac RENDERED KUSTOMIZED NAMESPACE SERVICE_ACCOUNT
      the ClusterRole and Role rules equal daemonset/rbac.yaml's as sets; both bindings bind the
      chart's roles to the chart's ServiceAccount in NAMESPACE
  test-helm.py can-i KUSTOMIZED NAMESPACE USER
      prints, per permission daemonset/rbac.yaml grants, a description and the
      SubjectAccessReview asking whether USER (the chart's ServiceAccount) has it, tab-separated,
      for the check on the real API server

Needs PyYAML (Debian: python3-yaml).
"""
import re
import sys

import yaml

failures = []


def check(cond, what):
    if cond:
        print(f"  ok: {what}")
    else:
        print(f"  FAILED: {what}")
        failures.append(what)


def docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def one(objs, kind, name=None):
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    if len(found) != 1:
        sys.exit(f"expected exactly one {kind}{' ' + name if name else ''}, found {len(found)}")
    return found[0]


def kebab(camel):
    return re.sub(r"([A-Z])", lambda m: "-" + m.group(1).lower(), camel)


def camel(flag):
    head, *rest = flag.split("-")
    return head + "".join(p.capitalize() for p in rest)


def run_flags(help_path):
    """{flag: {"value": takes a value, "default": str or None, "env": str or None}} from
    `podvolume-agent run --help` (clap's long help)."""
    flags, cur = {}, None
    with open(help_path) as f:
        for line in f:
            m = re.match(r"^\s+(?:-\w, )?--([a-z0-9-]+)(\S*)(?:\s+<[A-Z_]+>)?\s*$", line)
            if m:
                cur = m.group(1)
                flags[cur] = {"value": "<" in line, "default": None, "env": None}
                continue
            if cur is None:
                continue
            m = re.match(r"^\s+\[default: (.*)\]\s*$", line)
            if m:
                flags[cur]["default"] = m.group(1)
            m = re.match(r"^\s+\[env: ([A-Z_]+)=", line)
            if m:
                flags[cur]["env"] = m.group(1)
    flags.pop("help", None)
    return flags


def rendered_args(container, extra=0):
    """The container's arguments as {flag: value or True}, less the last `extra` (extraArgs)."""
    args = container["args"][: len(container["args"]) - extra]
    if args[0] != "run":
        sys.exit(f"the container's first argument is {args[0]!r}, not run")
    out = {}
    for a in args[1:]:
        flag, eq, val = a[2:].partition("=")
        out[flag] = val if eq else True
    return out


def container_of(ds):
    cs = ds["spec"]["template"]["spec"]["containers"]
    if len(cs) != 1:
        sys.exit(f"expected one container in DaemonSet node-agent, found {len(cs)}")
    return cs[0]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def fixed_identity(ds, ns):
    labels = ds["spec"]["template"]["metadata"]["labels"]
    check(ds["metadata"]["name"] == "node-agent", "DaemonSet is named node-agent")
    check(ds["metadata"].get("namespace") == ns, f"DaemonSet is in namespace {ns}")
    check(labels.get("name") == "node-agent", "pod template labelled name: node-agent (Velero <= 1.15)")
    check(labels.get("role") == "node-agent", "pod template labelled role: node-agent (Velero 1.16+)")
    sel = ds["spec"]["selector"]["matchLabels"]
    check(all(labels.get(k) == v for k, v in sel.items()), f"selector {sel} matches the pod template labels")


def cmd_defaults(rendered, kustomized, help_path, values_path, ns):
    objs, kust = docs(rendered), docs(kustomized)
    ds, kds = one(objs, "DaemonSet"), one(kust, "DaemonSet")
    c, kc = container_of(ds), container_of(kds)
    flags = run_flags(help_path)
    check(len(flags) >= 20, f"read {len(flags)} flags from `podvolume-agent run --help`")
    with open(values_path) as f:
        values_text = f.read()
    agent = yaml.safe_load(values_text)["agent"]

    print("- identity")
    fixed_identity(ds, ns)

    print("- every flag of `run` is a value of agent, with its comment")
    expected_keys = {camel(fl) for fl in flags if fl != "node-name"}
    check(set(agent) == expected_keys,
          f"agent's keys are the flags of run but --node-name (missing {sorted(expected_keys - set(agent))},"
          f" extra {sorted(set(agent) - expected_keys)})")
    import json
    import os
    with open(os.path.join(os.path.dirname(values_path), "values.schema.json")) as f:
        schema_agent = json.load(f)["properties"]["agent"]
    check(set(schema_agent["properties"]) == expected_keys and schema_agent.get("additionalProperties") is False,
          "values.schema.json describes exactly these agent values (and refuses others)")
    # The comment block right above each agent key names its flag and the binary's default.
    lines = values_text.splitlines()
    start = lines.index("agent:")
    for i in range(start + 1, len(lines)):
        m = re.match(r"^  ([A-Za-z]+):", lines[i])
        if not m:
            if lines[i] and not lines[i].startswith(" "):
                break
            continue
        key, j, comment = m.group(1), i - 1, []
        while j > start and lines[j].strip().startswith("#"):
            comment.insert(0, lines[j].strip())
            j -= 1
        fl = kebab(key)
        default = flags.get(fl, {}).get("default")
        want = "binary default"
        text = " ".join(comment)
        ok = f"--{fl} ({want}" in text
        if default == "false":
            ok = ok and f"--{fl} ({want} off)" in text
        elif default is not None:
            ok = ok and default in text
        check(ok, f"agent.{key} is commented with --{fl} and its binary default {default!r}")

    print("- the default values render the binary's defaults")
    args, env = rendered_args(c), env_of(c)
    for fl, spec in sorted(flags.items()):
        if fl == "node-name":
            check(fl not in args and env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                  == "spec.nodeName", "--node-name comes from NODE_NAME = spec.nodeName (downward API)")
        elif fl == "namespace":
            check(fl not in args and env.get("VELERO_NAMESPACE", {}).get("valueFrom", {}).get("fieldRef", {})
                  .get("fieldPath") == "metadata.namespace",
                  "--namespace comes from VELERO_NAMESPACE = the pod's (release) namespace")
        elif spec["default"] is None or spec["default"] == "false":
            check(fl not in args, f"--{fl} (no default / off) is not passed")
        else:
            check(args.get(fl) == spec["default"],
                  f"--{fl}={args.get(fl)} is the binary's default {spec['default']}")
    check(set(args) <= set(flags), f"every rendered argument is a flag of run ({sorted(set(args) - set(flags))})")

    print("- the same pod as daemonset/ (kubectl kustomize)")
    kargs = rendered_args(kc)
    check(all(args.get(k) == v for k, v in kargs.items()), f"daemonset/'s arguments are rendered alike: {kargs}")
    kenv = env_of(kc)
    check(all(env.get(k) == v for k, v in kenv.items()), f"daemonset/'s environment is rendered alike: {sorted(kenv)}")
    check(ds["metadata"]["name"] == kds["metadata"]["name"], "DaemonSet name as daemonset/'s")
    kl = kds["spec"]["template"]["metadata"]["labels"]
    check(all(ds["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in kl.items()),
          f"pod labels include daemonset/'s {kl}")
    check(ds["spec"]["template"]["metadata"].get("annotations") == kds["spec"]["template"]["metadata"].get("annotations"),
          "pod annotations as daemonset/'s")
    for field in ["selector", "updateStrategy"]:
        check(ds["spec"][field] == kds["spec"][field], f"spec.{field} as daemonset/'s")
    for field in ["serviceAccountName", "terminationGracePeriodSeconds", "tolerations", "securityContext",
                  "volumes", "priorityClassName", "nodeSelector", "affinity"]:
        check(ds["spec"]["template"]["spec"].get(field) == kds["spec"]["template"]["spec"].get(field),
              f"pod spec.{field} as daemonset/'s")
    for field in ["name", "image", "imagePullPolicy", "ports", "livenessProbe", "readinessProbe", "resources",
                  "securityContext", "volumeMounts"]:
        check(c.get(field) == kc.get(field), f"container {field} as daemonset/'s")

    print("- the other objects")
    sa = one(objs, "ServiceAccount")
    check(sa["metadata"]["name"] == "node-agent" and sa["metadata"].get("namespace") == ns,
          f"ServiceAccount node-agent in {ns}")
    svc = one(objs, "Service")
    check(svc["metadata"].get("namespace") == ns and svc["spec"]["ports"][0]["targetPort"] == "metrics"
          and svc["spec"]["ports"][0]["port"] == c["ports"][0]["containerPort"],
          "metrics Service on the container's metrics port")
    check(all(ds["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items()),
          "the Service selects the agent's pods")
    check(not [o for o in objs if o["kind"] == "ServiceMonitor"], "no ServiceMonitor by default")
    check(not [o for o in objs if o["kind"] == "CustomResourceDefinition"], "no CRDs (Velero owns them)")


def cmd_custom(rendered, values_path, ns):
    objs = docs(rendered)
    with open(values_path) as f:
        v = yaml.safe_load(f)
    ds = one(objs, "DaemonSet")
    c, spec = container_of(ds), ds["spec"]["template"]["spec"]
    a = v["agent"]
    print("- identity")
    fixed_identity(ds, ns)
    labels = ds["spec"]["template"]["metadata"]["labels"]
    check(all(labels.get(k) == val for k, val in v["podLabels"].items() if k not in ("name", "role")),
          "podLabels added to the pods")
    check(labels["role"] == "node-agent" and labels["name"] == "node-agent",
          f"podLabels cannot override name/role (tried {v['podLabels'].get('role')!r})")

    print("- every agent value becomes its flag")
    args = rendered_args(c, len(v["extraArgs"]))
    for key, val in a.items():
        fl = kebab(key)
        if val is True:
            check(args.get(fl) is True, f"agent.{key}: true -> --{fl}")
        elif val is False:
            check(fl not in args, f"agent.{key}: false -> no --{fl}")
        else:
            check(args.get(fl) == str(val), f"agent.{key}: {val} -> --{fl}={args.get(fl)}")
    check(c["args"][-len(v["extraArgs"]):] == v["extraArgs"], "extraArgs come last")
    env = env_of(c)
    check(all(env.get(e["name"]) == e for e in v["extraEnv"]), "extraEnv in the container")
    check(c.get("envFrom") == v["extraEnvFrom"], "extraEnvFrom in the container")
    check(env["VELERO_SCRATCH_DIR"]["value"] == a["scratchDir"], "VELERO_SCRATCH_DIR follows agent.scratchDir")

    print("- image, scheduling, resources")
    check(c["image"] == f"{v['image']['repository']}@{v['image']['digest']}", f"image by digest: {c['image']}")
    check(c["imagePullPolicy"] == v["image"]["pullPolicy"], "image.pullPolicy")
    check(spec.get("imagePullSecrets") == [{"name": n} for n in v["imagePullSecrets"]], "imagePullSecrets")
    for key in ["tolerations", "nodeSelector", "affinity", "priorityClassName", "terminationGracePeriodSeconds"]:
        check(spec.get(key) == v[key], f"{key}: {spec.get(key)}")
    check(c["resources"] == v["resources"], "resources")
    check(spec["serviceAccountName"] == v["serviceAccount"]["name"], "the pods run as serviceAccount.name")

    print("- volumes")
    vols = {x["name"]: x for x in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    check(vols["host-pods"]["hostPath"]["path"] == v["kubeletRootDir"].rstrip("/") + "/pods",
          f"host-pods hostPath {vols['host-pods']['hostPath']['path']} is kubeletRootDir/pods")
    check(mounts["host-pods"]["mountPath"] == a["hostPodsDir"], "host-pods mounted at agent.hostPodsDir")
    check(mounts["host-pods"].get("mountPropagation") == "HostToContainer", "host-pods HostToContainer")
    check(vols["state"]["hostPath"]["path"] == v["stateHostPath"], "state hostPath is stateHostPath")
    check(mounts["state"]["mountPath"] == a["stateDir"], "state mounted at agent.stateDir")
    check(mounts["scratch"]["mountPath"] == a["scratchDir"], "scratch mounted at agent.scratchDir")
    check(vols["cloud-credentials"]["secret"]["secretName"] == v["credentials"]["secretName"]
          and mounts["cloud-credentials"]["mountPath"] == v["credentials"]["mountPath"],
          "credentials Secret and mount path")
    check(all(vols.get(x["name"]) == x for x in v["extraVolumes"]), "extraVolumes in the pod")
    check(all(mounts.get(x["name"]) == x for x in v["extraVolumeMounts"]), "extraVolumeMounts in the container")

    print("- metrics")
    port = int(a["listenAddress"].rsplit(":", 1)[1])
    check(c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}],
          f"container port metrics = the port of agent.listenAddress ({port})")
    ann = ds["spec"]["template"]["metadata"].get("annotations", {})
    check(ann.get("prometheus.io/port") == str(port), "prometheus.io/port annotation follows it")
    check(all(ann.get(k) == val for k, val in v["podAnnotations"].items()), "podAnnotations")
    svc = one(objs, "Service")
    check(svc["spec"]["ports"][0]["port"] == v["metrics"]["service"]["port"]
          and svc["spec"]["ports"][0]["targetPort"] == "metrics", "Service port metrics.service.port -> metrics")
    sm = one(objs, "ServiceMonitor")
    check(sm["metadata"]["namespace"] == v["metrics"]["serviceMonitor"]["namespace"]
          and sm["spec"]["namespaceSelector"]["matchNames"] == [ns]
          and all(sm["metadata"]["labels"].get(k) == val for k, val in v["metrics"]["serviceMonitor"]["additionalLabels"].items())
          and all(svc["metadata"]["labels"].get(k) == val for k, val in sm["spec"]["selector"]["matchLabels"].items())
          and sm["spec"]["endpoints"][0]["port"] == "metrics"
          and sm["spec"]["endpoints"][0]["interval"] == v["metrics"]["serviceMonitor"]["interval"],
          "ServiceMonitor: its namespace and labels, selecting the metrics Service")

    print("- namespace and ServiceAccount")
    sa = one(objs, "ServiceAccount")
    check(sa["metadata"]["name"] == v["serviceAccount"]["name"]
          and sa["metadata"].get("annotations") == v["serviceAccount"]["annotations"],
          "ServiceAccount name and annotations")
    namespaced = [o for o in objs if o["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ServiceMonitor")]
    check(all(o["metadata"].get("namespace") == ns for o in namespaced),
          f"every namespaced object is in the release namespace {ns}")


def rule_set(rules):
    out = set()
    for r in rules:
        for verb in r.get("verbs") or []:
            for url in r.get("nonResourceURLs", []):
                out.add(("url", url, verb))
            for g in r.get("apiGroups", []):
                for res in r.get("resources", []):
                    for name in r.get("resourceNames") or ["*"]:
                        out.add((g, res, name, verb))
    return out


def cmd_rbac(rendered, kustomized, ns, sa):
    objs, kust = docs(rendered), docs(kustomized)
    for kind, binding in (("ClusterRole", "ClusterRoleBinding"), ("Role", "RoleBinding")):
        chart_role, kust_role = one(objs, kind), one(kust, kind)
        a, b = rule_set(chart_role["rules"]), rule_set(kust_role["rules"])
        check(a == b, f"{kind} rules equal daemonset/'s as sets ({len(a)} permissions;"
                      f" only in the chart: {sorted(a - b)}, only in daemonset/: {sorted(b - a)})")
        if kind == "Role":
            check(chart_role["metadata"].get("namespace") == ns, f"Role in {ns}")
        bind = one(objs, binding)
        check(bind["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": kind,
                                  "name": chart_role["metadata"]["name"]},
              f"{binding} refers to the chart's {kind} {chart_role['metadata']['name']}")
        check(bind["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
              f"{binding} binds exactly ServiceAccount {ns}/{sa}")
        if kind == "RoleBinding":
            check(bind["metadata"].get("namespace") == ns, f"RoleBinding in {ns}")


def cmd_can_i(kustomized, ns, user):
    """One line per permission daemonset/rbac.yaml grants: a description, a tab, and the
    SubjectAccessReview (JSON) that asks whether `user`, a ServiceAccount, has it: the question
    `kubectl auth can-i --as <user>` asks, put directly so that it does not depend on which
    resources the API server's discovery knows (BackupStorageLocations and BackupRepositories
    are Velero's CRDs, not installed here)."""
    import json
    sa_ns = user.split(":")[2]
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{sa_ns}", "system:authenticated"]
    kust = docs(kustomized)
    for kind in ("ClusterRole", "Role"):
        for entry in sorted(rule_set(one(kust, kind)["rules"])):
            spec = {"user": user, "groups": groups}
            if entry[0] == "url":
                spec["nonResourceAttributes"] = {"path": entry[1], "verb": entry[2]}
                what = f"{entry[2]} {entry[1]}"
            else:
                group, res, name, verb = entry
                res, _, sub = res.partition("/")
                attrs = {"group": group, "resource": res, "verb": verb}
                if sub:
                    attrs["subresource"] = sub
                if name != "*":
                    attrs["name"] = name
                if kind == "Role":
                    attrs["namespace"] = ns
                spec["resourceAttributes"] = attrs
                what = (f"{verb} {res}{'.' + group if group else ''}{'/' + sub if sub else ''}"
                        f"{' ' + name if name != '*' else ''} {'in ' + ns if kind == 'Role' else 'cluster-wide'}")
            review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
            print(what + "\t" + json.dumps(review))


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    {"defaults": cmd_defaults, "custom": cmd_custom, "rbac": cmd_rbac, "can-i": cmd_can_i}[cmd](*args)
    if failures:
        print(f"test-helm.py {cmd}: {len(failures)} check(s) failed:", *failures, sep="\n  ", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
