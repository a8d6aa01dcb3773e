#!/usr/bin/env bash
# The Helm chart's tests (charts/podvolume-agent), all with the real helm (scripts/install-helm.sh)
# and kubectl (scripts/install-control-plane.sh); part of the test command (scripts/test.sh runs it
# before the real-cluster pass), runnable alone:
#
#   scripts/test-helm.sh
#
# 1. The chart's appVersion is the agent's version (`podvolume-agent --version`).
# 2. `helm lint --strict` with the default values and with testdata/helm/custom-values.yaml.
# 3. `helm template` with the default values (scripts/test-helm.py defaults): the DaemonSet
#    node-agent and its labels name/role node-agent; every flag of `podvolume-agent run --help` is
#    a value, commented with its binary default, and renders as that default; the pod is
#    daemonset/'s (`kubectl kustomize daemonset/`); the ServiceAccount, the metrics Service, no
#    ServiceMonitor, no CRDs.
# 4. `helm template` with the non-default values (test-helm.py custom): each value where it belongs;
#    and the values the chart refuses, each with its message.
# 5. RBAC: the ClusterRole and Role rules of `helm template` (both value sets) equal those of
#    `kubectl kustomize daemonset/` as sets, bound to the chart's ServiceAccount (test-helm.py rbac).
# 6. On a real kube-apiserver (scripts/start-control-plane.sh, stopped on exit, also on failure):
#    the non-default rendering accepted by a server-side dry run; `helm install` refused over
#    daemonset/'s objects, then (those deleted, the CRDs kept) `helm install` into namespace
#    velero: the DaemonSet, its pod labels, the ServiceAccount, what the ServiceAccount may do (a
#    SubjectAccessReview for every permission of daemonset/rbac.yaml, `kubectl auth can-i --as`
#    for the main ones and for some it must not have), `helm upgrade` with a changed value,
#    `helm uninstall` removing every object.
#
# Needs: go (builds helm and the control plane once per machine, cached), cargo (the agent binary,
# for its --help), python3 with PyYAML. Measured on 2 shared cores once the tools are built:
# 22-35 s (about 10 s of it starting the control plane).
#
# Environment: PODVOLUME_TOOLS_CACHE (the tools cache, as the install scripts).
set -euo pipefail
{
cd "$(dirname "$0")/.."
root=$(pwd)
started=$(date +%s)
say() { echo "test-helm.sh: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

python3 -c 'import yaml' 2>/dev/null || fail "python3 cannot import yaml (Debian: apt-get install python3-yaml)"
helm=$(scripts/install-helm.sh)
cp_bin=$(scripts/install-control-plane.sh)
kubectl=$cp_bin/kubectl
cargo build --quiet --bin podvolume-agent
agent=$root/target/debug/podvolume-agent
chart=$root/charts/podvolume-agent
custom=$root/testdata/helm/custom-values.yaml
checks=$root/scripts/test-helm.py

work=$(mktemp -d /tmp/podvolume-helm.XXXXXX)
cp_dir=$work/cp
cp_started=
cleanup() {
  local rc=$?
  if [ -n "$cp_started" ]; then
    CONTROL_PLANE_BIN=$cp_bin scripts/start-control-plane.sh --stop "$cp_dir" >&2 || true
    if [ "$rc" -ne 0 ]; then
      for f in kube-apiserver kube-controller-manager; do
        echo "--- last lines of $cp_dir/$f.log" >&2
        tail -n 15 "$cp_dir/$f.log" >&2 || true
      done
    fi
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# helm's own configuration, cache and data in the scratch directory: nothing of the user's is read
# or written.
export HELM_CONFIG_HOME=$work/helm/config HELM_CACHE_HOME=$work/helm/cache HELM_DATA_HOME=$work/helm/data
export KUBECONFIG=$work/no-cluster-yet # helm template and lint never need one; install gets its own
h() { echo "+ helm $*" >&2; "$helm" "$@"; }

echo "== helm $("$helm" version --template '{{.Version}}'), kubectl $("$kubectl" version --client -o json | sed -n 's/.*"gitVersion": "\([^"]*\)".*/\1/p' | head -n1), $("$agent" --version) =="

echo "== 1. chart version =="
app_version=$("$helm" show chart "$chart" | sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p')
agent_version=$("$agent" --version | awk '{print $2}')
[ -n "$agent_version" ] && [ "$app_version" = "$agent_version" ] \
  || fail "Chart.yaml appVersion is '$app_version', the agent is '$agent_version' (Cargo.toml's version): update Chart.yaml"
echo "  ok: appVersion $app_version is the agent's version"

echo "== 2. helm lint =="
h lint --strict "$chart" --namespace velero
h lint --strict "$chart" --namespace backup-system -f "$custom"

echo "== 3. helm template, default values =="
h template podvolume-agent "$chart" --namespace velero >"$work/default.yaml"
"$kubectl" kustomize "$root/daemonset" >"$work/kustomized.yaml"
"$agent" run --help >"$work/run-help.txt"
python3 "$checks" defaults "$work/default.yaml" "$work/kustomized.yaml" "$work/run-help.txt" "$chart/values.yaml" velero

echo "== 4. helm template, non-default values ($custom) =="
h template pva "$chart" --namespace backup-system -f "$custom" >"$work/custom.yaml"
python3 "$checks" custom "$work/custom.yaml" "$custom" backup-system
h template podvolume-agent "$chart" --namespace velero --set agent.noInit=true >"$work/no-init.yaml"
grep -qx -- '            - --no-init' "$work/no-init.yaml" || fail "agent.noInit=true does not render --no-init"
echo "  ok: agent.noInit=true renders --no-init"
refused() { # <message the chart must give> <helm template arguments...>
  local want=$1 out
  shift
  if out=$("$helm" template podvolume-agent "$chart" --namespace velero "$@" 2>&1); then
    fail "helm template $* rendered; it must be refused with: $want"
  fi
  grep -qF -- "$want" <<<"$out" || fail "helm template $* was refused without saying '$want':"$'\n'"$out"
  echo "  ok: $* refused: $want"
}
# values.schema.json first (helm validates before rendering), then the templates' own checks
# (which also hold with --skip-schema-validation).
refused "at '/agent': additional properties 'concurency' not allowed" --set agent.concurency=2
refused "at '/agent/concurrency': minimum: got 0, want 1" --set agent.concurrency=0
refused "at '/agent/defaultUploader'" --set agent.defaultUploader=rsync
refused "at '/agent/apiAuth'" --set agent.apiAuth=token
refused "at '/agent/logFormat'" --set agent.logFormat=xml
refused "at '/agent/lockWait'" --set agent.lockWait=soon
refused "at '/agent/listenAddress'" --set agent.listenAddress=0.0.0.0
refused "at '/image/digest'" --set image.digest=latest
refused "agent.initMissingRepository and agent.noInit conflict" --set agent.noInit=true --set agent.initMissingRepository=true
refused "agent.defaultUploader must be restic or kopia" --skip-schema-validation --set agent.defaultUploader=rsync
refused "agent.apiAuth must be kubernetes or none" --skip-schema-validation --set agent.apiAuth=token
refused "agent.logFormat must be json or plain" --skip-schema-validation --set agent.logFormat=xml
refused "agent.listenAddress must end with :<port>" --skip-schema-validation --set agent.listenAddress=0.0.0.0
refused "metrics.serviceMonitor.enabled needs metrics.service.enabled" \
  --set metrics.serviceMonitor.enabled=true --set metrics.service.enabled=false
h template podvolume-agent "$chart" --namespace velero --set agent.stallTimeout=0 --set 'agent.operationTimeout=1h 30m' >"$work/durations.yaml"
grep -qx -- '            - --stall-timeout=0' "$work/durations.yaml" && grep -qx -- '            - --operation-timeout=1h 30m' "$work/durations.yaml" \
  || fail "agent.stallTimeout=0 (a number) and operationTimeout='1h 30m' do not render as such"
echo "  ok: agent.stallTimeout=0 (a number) and operationTimeout='1h 30m' render as such"

echo "== 5. RBAC: helm template and kubectl kustomize daemonset/ grant the same =="
python3 "$checks" rbac "$work/default.yaml" "$work/kustomized.yaml" velero node-agent
python3 "$checks" rbac "$work/custom.yaml" "$work/kustomized.yaml" backup-system backup-agent

echo "== 6. helm install on a real kube-apiserver =="
CONTROL_PLANE_BIN=$cp_bin scripts/start-control-plane.sh "$cp_dir" >"$work/cp.env"
cp_started=1
export KUBECONFIG=$cp_dir/admin.kubeconfig
k() { "$kubectl" "$@"; }
echo "  control plane: kube-apiserver $("$cp_bin/kube-apiserver" --version | cut -d' ' -f2)"
# What a cluster with Velero has before the chart: its namespace and the two CRDs.
k create namespace velero >/dev/null
k apply -f "$root/daemonset/crds.yaml" >/dev/null
k wait --for condition=established --timeout=60s crd/podvolumebackups.velero.io crd/podvolumerestores.velero.io >/dev/null
# The non-default rendering is valid for the real API server too (server-side dry run: schema
# validation and admission, nothing stored; the ServiceMonitor left out, its CRD is not here).
k create namespace backup-system >/dev/null
"$helm" template pva "$chart" --namespace backup-system -f "$custom" --set metrics.serviceMonitor.enabled=false \
  >"$work/custom-no-monitor.yaml"
k create --dry-run=server -f "$work/custom-no-monitor.yaml" >"$work/dry-run.out" \
  || fail "the API server refuses the objects rendered with $custom (above)"
echo "  ok: the API server accepts the non-default rendering (create --dry-run=server: $(wc -l <"$work/dry-run.out") objects)"
# A cluster where daemonset/ was applied: helm refuses to take its objects over (the README says
# to delete them first, with the selector that leaves the CRDs alone).
k apply -k "$root/daemonset" -l app.kubernetes.io/name=podvolume-agent >/dev/null
if out=$("$helm" install podvolume-agent "$chart" --namespace velero 2>&1); then
  fail "helm install took over the objects applied from daemonset/"
fi
grep -qF "cannot be imported into the current release" <<<"$out" \
  || fail "helm install over daemonset/'s objects failed otherwise than expected:"$'\n'"$out"
echo "  ok: helm install refuses daemonset/'s objects (exists and cannot be imported)"
k delete -k "$root/daemonset" -l app.kubernetes.io/name=podvolume-agent --wait >/dev/null
k get crd podvolumebackups.velero.io >/dev/null || fail "kubectl delete -k daemonset/ -l ... removed the CRDs"
echo "  ok: kubectl delete -k daemonset/ -l app.kubernetes.io/name=podvolume-agent removed them, the CRDs stay"
h install podvolume-agent "$chart" --namespace velero >"$work/install.out"
status=$("$helm" status podvolume-agent --namespace velero -o json | sed -n 's/.*"status":"\([a-z-]*\)".*/\1/p' | head -n1)
[ "$status" = deployed ] || fail "helm status says '$status', not deployed"
echo "  ok: release podvolume-agent deployed"

got=$(k -n velero get daemonset node-agent -o jsonpath='{.spec.template.metadata.labels.name} {.spec.template.metadata.labels.role} {.spec.template.spec.serviceAccountName} {.spec.selector.matchLabels.name}')
[ "$got" = "node-agent node-agent node-agent node-agent" ] \
  || fail "DaemonSet velero/node-agent: pod labels name, role, ServiceAccount, selector are '$got'"
echo "  ok: DaemonSet velero/node-agent, pods labelled name=node-agent role=node-agent, ServiceAccount node-agent"
# The DaemonSet controller has seen it (no nodes here, so no pods: rolled out at once).
k -n velero rollout status daemonset/node-agent --timeout=60s >/dev/null \
  || fail "the DaemonSet controller did not roll out node-agent within 60 s"
echo "  ok: the DaemonSet controller rolled it out"
k -n velero get serviceaccount node-agent >/dev/null || fail "ServiceAccount velero/node-agent missing"
echo "  ok: ServiceAccount velero/node-agent"

sa=system:serviceaccount:velero:node-agent
# Every permission of daemonset/rbac.yaml, asked as SubjectAccessReviews (kubectl auth can-i's
# question, independent of discovery: Velero's other CRDs are not installed here).
can=0
while IFS=$'\t' read -r what review; do
  answer=$(k create -o jsonpath='{.status.allowed}' -f - <<<"$review") || fail "SubjectAccessReview for '$what' not answered"
  [ "$answer" = true ] || fail "the ServiceAccount may not: $what (daemonset/rbac.yaml grants it; SubjectAccessReview answered '$answer')"
  can=$((can + 1))
done < <(python3 "$checks" can-i "$work/kustomized.yaml" velero "$sa")
[ "$can" -gt 0 ] || fail "no permission was checked"
echo "  ok: $sa may do each of the $can things daemonset/rbac.yaml grants (SubjectAccessReview)"
for allowed in "patch podvolumebackups.velero.io -n velero" "watch podvolumerestores.velero.io -n velero" \
  "patch podvolumerestores.velero.io --subresource=status -n velero" "get secrets -n velero" \
  "get pods --all-namespaces" "create events.events.k8s.io -n velero"; do
  # shellcheck disable=SC2086 # each entry is the argument list
  answer=$(k auth can-i --as "$sa" $allowed 2>/dev/null || true)
  [ "$answer" = yes ] || fail "kubectl auth can-i --as $sa $allowed answered '$answer', not yes"
  echo "  ok: kubectl auth can-i --as $sa $allowed: yes"
done
for denied in "list secrets -n velero" "watch secrets -n velero" "get secrets -n default" \
  "update podvolumebackups.velero.io -n velero" "delete podvolumebackups.velero.io -n velero" \
  "create podvolumebackups.velero.io -n velero" "patch podvolumebackups.velero.io -n default" \
  "list pods --all-namespaces" "get customresourcedefinitions.apiextensions.k8s.io/backups.velero.io" \
  "delete daemonsets.apps -n velero"; do
  # shellcheck disable=SC2086 # each entry is the argument list
  answer=$(k auth can-i --as "$sa" $denied 2>/dev/null || true)
  [ "$answer" = no ] || fail "the ServiceAccount may: kubectl auth can-i $denied (answer '$answer'); the chart must not grant it"
done
echo "  ok: it may not list/watch Secrets, read Secrets elsewhere, create/update/delete PodVolumeBackups, list pods, read other CRDs"

h upgrade podvolume-agent "$chart" --namespace velero --reuse-values --set agent.concurrency=3 >/dev/null
args=$(k -n velero get daemonset node-agent -o jsonpath='{.spec.template.spec.containers[0].args}')
grep -qF '"--concurrency=3"' <<<"$args" || fail "after helm upgrade --set agent.concurrency=3 the DaemonSet's args are $args"
echo "  ok: helm upgrade --set agent.concurrency=3 reaches the DaemonSet"

h uninstall podvolume-agent --namespace velero >/dev/null
left=
for _ in $(seq 1 60); do
  left=$(k get -n velero daemonset,serviceaccount,role,rolebinding,service -l app.kubernetes.io/instance=podvolume-agent -o name 2>/dev/null
    k get clusterrole,clusterrolebinding -l app.kubernetes.io/instance=podvolume-agent -o name 2>/dev/null)
  [ -z "$left" ] && break
  sleep 0.5
done
[ -z "$left" ] || fail "helm uninstall left: $left"
k -n velero get daemonset node-agent >/dev/null 2>&1 && fail "DaemonSet velero/node-agent still there after helm uninstall"
k -n velero get serviceaccount node-agent >/dev/null 2>&1 && fail "ServiceAccount velero/node-agent still there after helm uninstall"
k get crd podvolumebackups.velero.io >/dev/null || fail "helm uninstall removed the CRDs it did not install"
echo "  ok: helm uninstall removed the DaemonSet, ServiceAccount, RBAC and Service; the CRDs and namespace stay"

echo "== helm chart tests passed in $(($(date +%s) - started)) s =="
exit 0
}
